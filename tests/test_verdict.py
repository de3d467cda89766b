"""The verdict per test flight as a reviewer reads it: better or worse than the best baseline only where the
paired difference's interval over time blocks excludes 0, else level; never praise where the model has no
skill on the flight (R2 at or below 0, or no better than the flight's own mean)."""

import numpy as np
import pytest

from cloudml_lib.core.network.metrics import mae_difference, regression_metrics
from cloudml_lib.science import baselines, skill
from cloudml_lib.science.report import flight_verdicts, paper_lines, verdict

RNG = np.random.default_rng(3)


def report_of(true_km, net_km, base_km, frames, train_mean=1.0) -> dict:
    """A one-flight report as evaluate builds it (skill.height_scores, compare_baselines, against_best)."""
    flights = np.full(true_km.size, "F1")
    report = skill.height_scores(true_km, net_km, flights, frames, train_mean)
    predicted = {"linear": base_km, "mean": np.full(true_km.size, train_mean)}
    report["baselines"] = baselines.compare_baselines(true_km, net_km, flights, predicted, {})
    best = report["baselines"]["best"]["per_flight"]
    report["against_best"] = skill.against_best(best, true_km, net_km, flights, frames, predicted)
    report["own_mean_mae_km"] = skill.own_mean_mae(true_km, flights)
    return report


def a_clear_win() -> dict:
    """A flight where the network (errors of 0.03 km) beats its baseline (0.3 km) far beyond noise."""
    true_km, frames = flight()
    net, base = (true_km + RNG.normal(0, sd, true_km.size) for sd in (0.03, 0.3))
    return report_of(true_km, net, base, frames)


def flight(n=300):
    true_km = 0.5 + 1.2 * RNG.random(n)
    return true_km, np.arange(n) * 3  # labels every third frame


def test_the_paired_difference_is_level_when_its_interval_holds_zero_and_better_when_not():
    true_km, frames = flight()
    a = true_km + RNG.normal(0, 0.2, true_km.size)
    b = true_km + RNG.normal(0, 0.2, true_km.size)
    level = mae_difference(true_km, a, b, frames)
    assert level["interval_km"][0] < 0 < level["interval_km"][1]
    better = mae_difference(true_km, true_km + RNG.normal(0, 0.05, true_km.size), b, frames)
    assert better["interval_km"][1] < 0 and better["mae_difference_km"] < 0
    assert mae_difference(true_km[:4], a[:4], b[:4], frames[:4]) is None  # too few heights


def test_a_network_level_with_its_best_baseline_is_said_level_not_praised():
    true_km, frames = flight()
    net = true_km + RNG.normal(0, 0.15, true_km.size)
    base = true_km + RNG.normal(0, 0.15, true_km.size)
    report = report_of(true_km, net, base, frames)
    assert report["against_best"]["F1"]["call"] == "level"
    said = verdict(report)
    assert "level with" in said and "not shown to add to it" in said and "beats every baseline" not in said
    assert said.startswith("Verdict: this model is not useful yet on F1")


def test_a_network_better_beyond_the_interval_beats_every_baseline_with_its_interval_said():
    report = a_clear_win()
    said = flight_verdicts(report)["F1"]
    assert "the model beats every baseline" in said and "better than" in said and "95% interval" in said


def test_no_praise_where_the_model_has_no_skill_on_the_flight_though_it_beats_the_baselines():
    true_km, frames = flight()
    net = np.full(true_km.size, true_km.mean()) + RNG.normal(0, 0.2, true_km.size)  # its own mean, and noise
    base = np.full(true_km.size, 3.0)  # a baseline far off: the network beats it by a wide margin
    report = report_of(true_km, net, base, frames, train_mean=3.0)
    assert regression_metrics(true_km, net)["r2"] < 0 and regression_metrics(true_km, net)["std_ratio"] > 0.3
    said = verdict(report)
    assert "it has no skill there" in said and "beats" not in said.split("F1")[0]
    assert "not useful yet" in said


def test_numbers_as_papers_report_them_with_the_effective_sample_size_of_correlated_residuals():
    n = 2000
    err = np.zeros(n)
    for i in range(1, n):  # AR(1) residuals, r = 0.8: about n (1 - r) / (1 + r) = n / 9 independent heights
        err[i] = 0.8 * err[i - 1] + RNG.normal(0, 0.1)
    true_km = 0.5 + RNG.random(n)
    frames = np.arange(n)[::-1]  # given out of time order: sorted by frame before the lag is taken
    rec = skill.as_papers_report(true_km, true_km + err[::-1], np.full(n, "F1"), frames)
    r = rec["per_flight"]["F1"]
    assert 0.75 < r["lag1_residuals"] < 0.85 and abs(r["lag1_labels"]) < 0.1
    assert n / 12 < r["effective_n"] < n / 7
    assert r["median_ae_km"] == pytest.approx(np.median(np.abs(err)))
    assert r["within_0.1_km"] == pytest.approx(np.mean(np.abs(err) <= 0.1), abs=1e-3) and rec[
        "tolerances_km"
    ] == [0.1, 0.25]
    lines = "\n".join(paper_lines({"as_papers_report": rec}))
    assert f"about {r['effective_n']:.0f} independent heights of {n}" in lines
    # the tolerances are settable (train.tolerances_km), and a wrong one is named
    own = skill.as_papers_report(true_km, true_km + err[::-1], np.full(n, "F1"), frames, [0.05, 0.5])
    assert own["tolerances_km"] == [0.05, 0.5] and set(own["mean_over_flights"]) == {
        "median_ae_km",
        "within_0.05_km",
        "within_0.5_km",
    }
    assert own["per_flight"]["F1"]["within_0.5_km"] == pytest.approx(np.mean(np.abs(err) <= 0.5), abs=1e-3)
    from cloudml_lib.base.config import load_config
    from cloudml_lib.base.errors import ConfigError

    assert load_config(None, ["train.tolerances_km=[0.5]"]).train.tolerances_km == [0.5]
    with pytest.raises(ConfigError, match=r"train.tolerances_km: \[0, 1\] is not valid"):
        load_config(None, ["train.tolerances_km=[0, 1]"])


def test_intervals_short_of_their_target_beyond_chance_or_too_wide_are_said():
    from cloudml_lib.science.report import interval_warnings, short_of_target

    assert short_of_target(0.63, 70, 0.9) and not short_of_target(0.86, 70, 0.9)  # 60 of 70 is chance
    iv = {
        "coverage_target": 0.9,
        "per_flight": {
            "F1": {"coverage": 0.06, "n": 70, "mean_width_km": 0.3},
            "F2": {"coverage": 0.88, "n": 50, "mean_width_km": 0.94},
        },
    }
    said = interval_warnings(iv, [0.12, 1.98])
    assert said[0].startswith("On F1 the intervals hold 6% of 70 heights for a 90% target: short of it")
    assert len(said) == 2 and "0.94 km wide" in said[1] and "too wide to inform a height" in said[1]
    from cloudml_lib.science.report import test_parts

    report = a_clear_win()  # the notebook shows the head and folds the rest: the shortfall is in the head
    report["intervals"] = {**iv, "method": "conformal_absolute", "calibration": "the validation data"}
    report["training_label_range_km"] = [0.12, 1.98]
    head, more = test_parts(report)
    assert any(line.startswith("On F1 the intervals hold 6% of 70") for line in head)
    assert not any("On F1 the intervals hold" in line for line in more)


def test_a_validation_unlike_the_test_flight_is_said_in_the_verdict():
    report = a_clear_win()
    report["validation"] = {"pooled": {"r2": 0.03, "bias_km": 0.32}}
    said = verdict(report)
    assert "disagree with the test flights (validation R2 0.03, bias +0.32 km; test R2 0.9" in said


def test_the_cloud_verdict_sends_no_one_to_another_flag_on_a_difference_within_noise():
    from cloudml_lib.science.clouds import cloud_report
    from cloudml_lib.science.report import cloud_verdict

    rng = np.random.default_rng(3)  # its own draws: no other test's use of RNG changes this one's data
    n = 600
    frames = np.arange(n) * 2
    flags = (np.sin(frames / 40.0) > 0).astype(int)  # cloud in long stretches, as along a flight
    p10 = np.where(flags == 1, 270.0, 290.0) + rng.normal(0, 6, n)  # colder under cloud, noisy
    train = {"flag": flags, "p10": p10 + rng.normal(0, 1, n)}
    flights = np.full(n, "F1")
    own = p10 < 280  # the threshold's own flag, nearly
    level_prob = own.astype(float) * 0.8 + 0.1
    wrong, right = np.flatnonzero(own != flags), np.flatnonzero(own == flags)
    k = min(10, len(wrong))  # k frames put right and k put wrong: as accurate, the difference is noise
    flip = np.r_[wrong[:k], right[:: max(1, len(right) // k)][:k]]
    level_prob[flip] = 1 - level_prob[flip]
    report = {"cloud": cloud_report(flags, level_prob, flights, p10, train, 0.5, False, frames)}
    a = report["cloud"]["accuracy_against"]["bt_threshold"]
    assert a["call"] == "level" and a["interval"][0] < 0 <= a["interval"][1]
    said = cloud_verdict(report)
    assert "level: accuracy" in said and "--cloud-flag bt_threshold" not in said
    worse_prob = np.where(rng.random(n) < 0.3, 1 - flags, flags).astype(float)  # 30% wrong everywhere
    report = {"cloud": cloud_report(flags, worse_prob, flights, p10, train, 0.5, False, frames)}
    said = cloud_verdict(report)
    assert report["cloud"]["accuracy_against"]["bt_threshold"]["call"] == "worse"
    assert "worse: accuracy" in said and "predict --cloud-flag bt_threshold" in said


@pytest.mark.slow
def test_a_test_flight_of_high_cloud_alone_is_said_so_and_scored_for_its_cloud_flag(
    tiny_flights, tmp_path, logs_reach_caplog, caplog
):
    """Every CPL base of the test flight 5 km higher, above data.cbh_max_km: the run trains, its report says
    the flight has no height label in the product's range (not the time-format advice) and scores its cloud
    flag; the same flight as a training flight is refused, naming it."""
    import shutil

    import h5py
    import yaml
    from conftest import assert_reads_back, tiny_raw

    import cloudml_lib as cml
    from cloudml_lib.base.errors import DataError

    root, entries = tiny_flights
    data = tmp_path / "flights"
    shutil.copytree(root, data)
    with h5py.File(data / entries[2]["cpl_file"], "r+") as f:
        bases = f["layer_descriptor/Layer_Base_Altitude"]
        values = bases[...]
        values[values > 0] += 5.0
        bases[...] = values
    raw = tiny_raw(data, entries, tmp_path / "cache")
    raw["train"]["epochs"] = 1
    raw["data"]["validation"] = [entries[1]["name"]]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    report = cml.fit(tmp_path / "c.yaml", tmp_path / "run").report()
    name = entries[2]["name"]
    assert report["no_height_label"] == [name] and report["overall"]["n"] == 0
    assert report["verdict"].startswith(f"No height label on test flight {name}: every cloud base")
    assert report["cloud"]["model"]["per_flight"][name]["n"] > 20  # its cloud flag scored
    log = caplog.text  # the flights are read before the run's log is open
    assert f"flight {name}: every cloud base the lidar measured while the camera recorded" in log
    assert "above 2 km, 0 below 0.1 km" in log and "ir_time_format" not in log
    assert "evaluation.json" in assert_reads_back(tmp_path / "run")
    raw["data"].update(test_flights=[entries[0]["name"]], validation=[entries[1]["name"]])
    (tmp_path / "c2.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(DataError, match=f"no usable height label: {name};.*can only be a test flight"):
        cml.fit(tmp_path / "c2.yaml", tmp_path / "run2")
