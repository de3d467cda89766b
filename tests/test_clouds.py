"""Cloud / no-cloud: labels on every frame a profile matches (clear sky included), the metrics and the
two baselines, the joint loss, the probe fitted after training, and prediction intervals (MAPIE)
measured on flights never seen."""

import json

import h5py
import numpy as np
import pytest
import torch

from cloudml_lib.core.network.metrics import cloud_metrics
from cloudml_lib.core.network.model import MultimodalRegressionModel, Outputs
from cloudml_lib.data import cpl
from cloudml_lib.science import intervals
from cloudml_lib.science.clouds import cloud_report, fit_threshold
from cloudml_lib.train.loss import global_totals, part_loss


def test_every_matched_profile_labels_its_frame_clear_sky_included(tiny_config):
    data = tiny_config.data
    flight = data.flights[0]
    labels = cpl.read_flight_labels(flight, data)
    with h5py.File(f"{data.dir}/{flight.cpl_file}") as f:
        n_layers = f["layer_descriptor/Number_Layers"][:]
    assert labels.counts["cloud_labels"] == len(labels.frame_index) > labels.heights == labels.counts["kept"]
    assert np.all(np.diff(labels.frame_index) > 0)  # one sample per frame, in order
    clear = labels.cloud == 0
    assert clear.sum() == labels.counts["clear_sky"] > 3 and (n_layers == 0).sum() >= clear.sum()
    assert np.isnan(labels.cbh_km[clear]).all()  # no height over clear sky
    assert (labels.cloud[np.isfinite(labels.cbh_km)] == 1).all()  # every height comes with a cloud
    # clouds outside the label range (the cirrus-only profiles) are cloud without a height
    assert ((labels.cloud == 1) & np.isnan(labels.cbh_km)).sum() > 0


def test_cloud_metrics_and_the_brightness_temperature_threshold():
    flag = np.array([1, 1, 1, 0, 0, 0, 1, 0])
    m = cloud_metrics(flag, np.array([0.9, 0.8, 0.4, 0.1, 0.2, 0.6, 0.7, 0.3]))
    assert m["accuracy"] == pytest.approx(6 / 8) and m["f1"] == pytest.approx(0.75)
    assert m["roc_auc"] == pytest.approx(15 / 16) and m["cloud_share"] == 0.5
    assert cloud_metrics(np.ones(4), np.full(4, 0.9))["roc_auc"] is None  # one class: no AUC, no crash
    p10 = np.array([210.0, 215, 220, 280, 285, 290])  # cold frames are cloudy
    assert 220 < fit_threshold(p10, np.array([1, 1, 1, 0, 0, 0])) < 280
    train = {"flag": np.array([1, 1, 1, 0]), "p10": np.array([200.0, 210, 220, 290])}
    report = cloud_report(
        np.array([1, 0, 1]),
        np.array([0.8, 0.3, 0.2]),
        np.array(["a", "a", "b"]),
        np.array([205.0, 295, 230]),
        train,
        0.5,
    )
    assert report["majority"]["overall"]["accuracy"] == pytest.approx(2 / 3)  # always "cloud"
    assert report["bt_threshold"]["overall"]["accuracy"] == 1.0
    assert report["model"]["per_flight"]["b"]["accuracy"] == 0.0
    assert set(report["model"]["per_flight"]) == {"a", "b"}


def test_the_joint_loss_ignores_missing_heights_and_splits_exactly():
    torch.manual_seed(0)
    raw = torch.randn(6, 2, requires_grad=True)
    out = Outputs(raw[:, 0], raw[:, 1])
    part = {
        "target": torch.randn(6),
        "has_height": torch.tensor([1.0, 0, 1, 1, 0, 1]),
        "cloud": torch.tensor([1.0, 0, 1, 1, 1, 1]),
        "weight": torch.tensor([1.0, 1, 2, 1, 1, 1]),
    }
    totals = global_totals(part, lambda x: x)
    whole = part_loss(out, part, totals, 1.0, 0.0, 0.5)
    h = part["has_height"] > 0
    w = part["weight"][h]
    huber = torch.nn.functional.huber_loss(raw[h, 0], part["target"][h], reduction="none")
    bce = torch.nn.functional.binary_cross_entropy_with_logits(raw[:, 1], part["cloud"], reduction="none")
    expected = (huber * w).sum() / w.sum() + 0.5 * (bce * part["weight"]).sum() / part["weight"].sum()
    assert float(whole.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    pieces = sum(
        part_loss(Outputs(raw[s, 0], raw[s, 1]), {k: v[s] for k, v in part.items()}, totals, 1.0, 0.0, 0.5)
        for s in (slice(0, 1), slice(1, 4), slice(4, 6))
    )  # micro-batches, one without a height
    assert float(pieces) == pytest.approx(float(whole), rel=1e-6)
    # the target of a sample without a height never matters
    changed = dict(part, target=torch.where(h, part["target"], torch.tensor(1e6)))
    assert float(part_loss(out, changed, totals, 1.0, 0.0, 0.5)) == pytest.approx(float(whole), rel=1e-6)


def test_the_model_has_a_cloud_output_only_when_asked():
    frames, scalars = torch.randn(3, 2, 16, 16), torch.randn(3, 3)
    joint = MultimodalRegressionModel(channels=[4, 4, 4], cloud_head="joint").eval()
    height, logit, classes = joint(frames, scalars)
    assert height.shape == logit.shape == (3,) and classes is None  # one flag, no classes
    plain = MultimodalRegressionModel(channels=[4, 4, 4]).eval()
    height, logit, classes = plain(frames, scalars)
    assert height.shape == (3,) and logit is None and classes is None
    with pytest.raises(ValueError, match="cloud_head"):
        MultimodalRegressionModel(channels=[4, 4, 4], cloud_head="both")


def test_a_probe_leaves_the_height_network_as_without_one_until_it_is_fitted():
    frames, scalars = torch.randn(5, 3, 16, 16), torch.randn(5, 3)
    torch.manual_seed(3)
    plain = MultimodalRegressionModel(channels=[4, 4, 4], cloud_head="none")
    after_plain = torch.rand(4)
    torch.manual_seed(3)
    probe = MultimodalRegressionModel(channels=[4, 4, 4], cloud_head="probe")
    assert torch.equal(torch.rand(4), after_plain)  # the same draws: the same training after it
    shared = plain.state_dict()
    assert all(torch.equal(v, probe.state_dict()[k]) for k, v in shared.items())
    assert set(probe.state_dict()) - set(shared) == {"cloud.weight", "cloud.bias", "cloud_fitted"}
    # unfitted: the height alone, and the probe gets no gradient from training
    out = probe.train()(frames, scalars)
    assert out.height.shape == (5,) and out.cloud_logit is None
    out.height.sum().backward()
    assert probe.cloud.weight.grad is None and not probe.cloud.weight.requires_grad
    probe.eval()
    height_before = probe(frames, scalars).height.detach()
    weight = torch.randn(probe.cloud.in_features)
    probe.set_cloud_probe(weight, 0.25)
    height, logit, _ = probe(frames, scalars)
    assert torch.equal(height, height_before)  # the height is not touched by the fit
    torch.testing.assert_close(logit, probe.features(frames, scalars) @ weight + 0.25)
    # the fitted flag travels with the weights; a model loaded from them answers a cloud logit at once
    again = MultimodalRegressionModel(channels=[4, 4, 4], cloud_head="probe").eval()
    assert not again.cloud_output
    again.load_state_dict(probe.state_dict())
    assert again.cloud_output and again(frames, scalars).cloud_logit.shape == (5,)
    again.clear_cloud_probe()
    assert again(frames, scalars).cloud_logit is None


def test_the_probe_is_a_logistic_regression_on_the_raw_features():
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score

    from cloudml_lib.science.clouds import fit_probe

    rng = np.random.default_rng(0)
    n = 600
    flag = (rng.random(n) < 0.6).astype(int)
    features = np.c_[
        rng.normal(0, 1, (n, 3)) * [1.0, 10.0, 0.01], np.full(n, 7.0)
    ]  # scales 0.01 to 10, a constant
    features[:, 1] += 80.0 * flag  # the one informative feature, on a large scale
    weight, bias = fit_probe(features, flag)
    assert weight.shape == (1, 4) and bias.shape == (1,)  # one logit: the flag
    weight, bias = weight[0], bias[0]
    logit = features @ weight + bias
    assert roc_auc_score(flag, logit) > 0.99
    assert np.mean((logit > 0) == flag) > 0.95
    assert weight[3] == 0.0  # a constant feature carries no weight
    # the same as scikit-learn's fit on the standardised features
    z = (features[:, :3] - features[:, :3].mean(0)) / features[:, :3].std(0)
    ref = LogisticRegression(C=1.0, max_iter=5000).fit(z, flag)
    np.testing.assert_allclose(logit, ref.decision_function(z), rtol=1e-4, atol=1e-4)
    # rows with non-finite features are left out; one class only: nothing to fit
    features[:5] = np.nan
    assert fit_probe(features, flag) is not None
    assert fit_probe(features, np.ones(n, int)) is None


def test_conformal_intervals_match_the_split_conformal_quantile():
    rng = np.random.default_rng(0)
    pred = rng.uniform(0.3, 2.0, 400)
    true = pred + rng.normal(0, 0.1, 400)
    cal = intervals.calibrate(pred, true, "conformal_absolute", 0.9, "test")
    lower, upper = intervals.bounds(np.array([1.0, 0.5]), cal)
    scores = np.sort(np.abs(true - pred))
    q = scores[int(np.ceil(401 * 0.9)) - 1]  # the conformal quantile
    np.testing.assert_allclose(upper - [1.0, 0.5], q, atol=1e-4)
    np.testing.assert_allclose([1.0, 0.5] - lower, q, atol=1e-4)
    gamma = intervals.calibrate(pred, true, "conformal_gamma", 0.9, "test")
    lo, up = intervals.bounds(np.array([0.5, 2.0]), gamma)
    assert (up - lo)[1] == pytest.approx(4 * (up - lo)[0], rel=1e-6)  # width proportional to the height
    assert intervals.calibrate(pred[:5], true[:5], "conformal_absolute", 0.9, "test") is None  # too few


def test_coverage_on_a_flight_never_seen_and_the_verdict():
    rng = np.random.default_rng(1)
    by_flight = {}
    for name, noise in (("calm1", 0.05), ("calm2", 0.05), ("calm3", 0.05), ("rough", 0.4)):
        pred = rng.uniform(0.3, 2.0, 300)
        by_flight[name] = (pred, pred + rng.normal(0, noise, 300))
    result = intervals.leave_one_flight_out(by_flight, 0.9)
    absolute = result["methods"]["conformal_absolute"]["per_flight"]
    # calibrated on the other flights: the rough flight's intervals are too narrow, the calm ones too wide
    assert absolute["rough"]["coverage"] < 0.6 and absolute["calm1"]["coverage"] > 0.95
    assert result["chosen"] in intervals.METHODS
    assert any("On flight rough" in v and "far below the target" in v for v in result["verdicts"])
    assert not any("On flight calm1" in v for v in result["verdicts"])
    # the estimate to quote: each flight's method chosen on the other flights alone, so what a flight's
    # heights are cannot change the method it is scored with (only its own score)
    nested = result["nested"]["per_flight"]
    assert set(nested) == set(by_flight) and all(p["method"] in intervals.METHODS for p in nested.values())
    for name, p in nested.items():
        assert p["coverage"] == result["methods"][p["method"]]["per_flight"][name]["coverage"]
    pred, true = by_flight["rough"]
    wild = {**by_flight, "rough": (pred, pred + rng.normal(0, 3.0, pred.size))}
    again = intervals.leave_one_flight_out(wild, 0.9)["nested"]["per_flight"]
    assert again["rough"]["method"] == nested["rough"]["method"]
    assert again["rough"]["coverage"] < nested["rough"]["coverage"]
    two = intervals.leave_one_flight_out({k: by_flight[k] for k in ("calm1", "rough")}, 0.9)
    assert {p["method"] for p in two["nested"]["per_flight"].values()} == {
        "conformal_absolute"
    }  # nothing to choose on


@pytest.mark.slow
def test_a_probe_run_trains_the_height_as_a_height_only_run_and_adds_the_cloud_output(
    tiny_raw_config, tmp_path
):
    import copy

    from cloudml_lib.base.config import build_config
    from cloudml_lib.commands.runs import train_run

    reports = {}
    for mode in ("probe", "none"):
        raw = copy.deepcopy(tiny_raw_config)
        raw["model"]["cloud_head"] = mode
        raw["train"]["epochs"] = 1
        reports[mode] = train_run(build_config(raw), tmp_path / mode, resume="never")
    probe, plain = reports["probe"], reports["none"]

    def epochs(mode):
        rows = [json.loads(line) for line in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
        return [(r["train_loss"], r["val_loss"], r["mae_km"]) for r in rows if r["kind"] == "epoch"]

    assert epochs("probe") == epochs("none")  # trained and scored exactly alike
    # the final scoring batches the clear-sky frames in too: the same heights to float32 rounding (R2, a
    # difference of two near-equal sums, to an absolute 1e-6: a model scoring R2 near 0 moves it by 2e-8)
    for k in ("r2", "mae_km", "rmse_km", "n"):
        assert probe["overall"][k] == pytest.approx(plain["overall"][k], rel=1e-5, abs=1e-6 * (k == "r2"))
    assert "model" in probe["cloud"] and "model" not in plain["cloud"]
    model, bt = probe["cloud"]["model"]["overall"], probe["cloud"]["bt_threshold"]["overall"]
    assert model["n"] == bt["n"] > probe["overall"]["n"]  # scored on the clear-sky frames as well
    assert 0.0 <= model["accuracy"] <= 1.0 and model["roc_auc"] is not None
    # the brightness baseline is fitted on every matched training frame (clear sky included), as evaluate does
    from cloudml_lib.science.evaluate import evaluate_run

    again = evaluate_run(tmp_path / "probe", write=False)["cloud"]
    for method in ("model", "bt_threshold", "majority"):
        for k in ("accuracy", "f1", "roc_auc", "n"):
            assert again[method]["overall"][k] == pytest.approx(
                probe["cloud"][method]["overall"][k], rel=1e-9
            )
    said = (tmp_path / "probe" / "train.log").read_text()
    assert "Cloud / no-cloud output fitted on the trained network's features" in said and "clear sky)" in said


@pytest.mark.slow
def test_a_joint_run_trains_both_outputs_and_evaluates_as_saved(tiny_raw_config, tmp_path):
    import copy

    from cloudml_lib.base.config import build_config
    from cloudml_lib.commands.runs import train_run
    from cloudml_lib.science.evaluate import evaluate_run

    raw = copy.deepcopy(tiny_raw_config)
    raw["model"]["cloud_head"] = "joint"
    raw["train"]["epochs"] = 1
    report = train_run(build_config(raw), tmp_path / "joint", resume="never")
    best = torch.load(tmp_path / "joint" / "best.pt", weights_only=True)
    assert best["model"]["head.4.weight"].shape[0] == 2 and "cloud.weight" not in best["model"]
    model = report["cloud"]["model"]["overall"]
    assert model["n"] == report["cloud"]["bt_threshold"]["overall"]["n"] > report["overall"]["n"]
    epoch = [
        json.loads(line)
        for line in (tmp_path / "joint" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "epoch"
    ]
    assert epoch and epoch[0]["cloud_accuracy"] is not None  # scored every epoch: trained with the height
    again = evaluate_run(tmp_path / "joint", write=False)
    assert again["cloud"]["model"]["overall"]["accuracy"] == pytest.approx(model["accuracy"])
    assert again["overall"]["mae_km"] == pytest.approx(report["overall"]["mae_km"], rel=1e-5)


def test_the_cloud_flag_marks_a_cloud_base_in_the_heights_range_and_names_the_other_clouds(tiny_config):
    """A cloud and a cloud base mean the same cloud: the flag says a base lies in the height product's range;
    high cloud alone and a base below the range are classes of their own, and get no height."""
    base = np.array([np.nan, 0.5, 9.0, 0.05, 2.0, np.nan])
    cloud = np.array([0, 1, 1, 1, 1, 1])  # the last: a layer whose base is a fill value
    classes = cpl.cloud_classes(base, cloud, 0.1, 2.0)
    assert classes.tolist() == [cpl.CLEAR, cpl.BASE_IN_RANGE, cpl.BASE_ABOVE, cpl.BASE_BELOW, 1, 1]
    data = tiny_config.data
    labels = cpl.read_flight_labels(data.flights[0], data)
    classes = cpl.cloud_classes(labels.layer_base_km, labels.cloud, data.cbh_min_km, data.cbh_max_km)
    heights = np.isfinite(labels.cbh_km)
    assert (classes[heights] == cpl.BASE_IN_RANGE).all()  # every height is a base in the range
    assert (classes[labels.cloud == 0] == cpl.CLEAR).all()
    # the demo's cirrus-only profiles: cloud under the old flag, their own class now
    assert ((labels.cloud == 1) & (classes == cpl.BASE_ABOVE)).sum() > 0


def test_the_probe_learns_the_cloud_classes_and_answers_the_flags_probability():
    from cloudml_lib.core.network.metrics import cloud_class, softmax
    from cloudml_lib.core.network.model import in_range_logit
    from cloudml_lib.science.clouds import fit_probe

    rng = np.random.default_rng(0)
    centres = np.array([[0.0, 0.0], [3.0, 0.0], [0.0, 3.0]])  # clear, a base in range, high cloud alone
    labels = np.repeat([cpl.CLEAR, cpl.BASE_IN_RANGE, cpl.BASE_ABOVE], 100)
    features = centres[np.repeat([0, 1, 2], 100)] + rng.normal(0, 0.5, (300, 2))
    weight, bias = fit_probe(features, labels, classes=len(cpl.CLASS_MEANINGS))
    assert weight.shape == (4, 2) and bias[cpl.BASE_BELOW] <= -100  # a class no frame holds: impossible
    logits = torch.as_tensor(features @ weight.T + bias)
    prob = torch.sigmoid(in_range_logit(logits)).numpy()
    np.testing.assert_allclose(prob, softmax(logits.numpy())[:, cpl.BASE_IN_RANGE], atol=1e-6)
    found = cloud_class(prob, softmax(logits.numpy()), 0.5)
    assert (found == labels).mean() > 0.95
    # two classes only (no high cloud in the training frames): one logit, placed as the classes' softmax
    two = labels < 2
    weight, bias = fit_probe(features[two], labels[two], classes=4)
    assert (weight[2:] == 0).all() and (bias[2:] <= -100).all()
    assert fit_probe(features[:10], np.zeros(10, int), classes=4) is None  # one class: nothing to separate


def test_the_brightness_temperature_baseline_is_a_window_for_a_base_in_range():
    from cloudml_lib.science.clouds import bt_flag, fit_window, fitted_baseline, window_score

    # warm sea (clear), a low cloud a little colder, high cloud much colder: the base in range is a window
    p10 = np.concatenate([np.full(50, 290.0), np.full(40, 280.0), np.full(10, 230.0)]) + np.arange(100) * 1e-3
    flag = np.repeat([0, 1, 0], [50, 40, 10])
    low, high = fit_window(p10, flag)
    assert 230.1 < low < 280.0 and 280.1 < high < 290.0
    assert cloud_metrics(flag, window_score(p10, (low, high)), 0.0)["accuracy"] == 1.0
    one_sided = fit_threshold(p10, flag)  # a threshold calls the high cloud a base in range
    assert cloud_metrics(flag, -p10, -one_sided)["accuracy"] == 0.9
    fitted = fitted_baseline({"flag": flag, "p10": p10}, window=True)
    assert fitted == {"kind": "window", "low": low, "high": high}
    assert bt_flag(np.array([295.0, 281.0, 200.0, np.nan]), fitted).tolist() == [0, 1, 2, -1]
    assert fit_window(p10, np.zeros(100)) == (float("inf"), float("-inf"))  # calling nothing cloud is best


@pytest.mark.parametrize("n", [1, 7, 4097, 33333])
def test_the_validation_loss_is_the_training_objectives_terms_with_the_value_it_had(n):
    """The validation loss is computed by the training loss's own terms (weighted_huber and the cloud
    cross-entropy, every sample weighing one), and its value is bit for bit what the plain means of the
    release before gave (written out here as the reference): early stopping and best.pt choose as before."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from cloudml_lib.train.loss import validation_loss

    rng = np.random.default_rng(n)
    for _ in range(10):
        out = {"height": rng.normal(size=n) * 3, "cloud_logit": rng.normal(size=n) * 2}
        target, has, flags = rng.normal(size=n), rng.random(n) < 0.7, rng.random(n) < 0.5
        train = SimpleNamespace(height_loss_weight=0.5 + rng.random(), huber_delta=0.1 + rng.random())
        train.cloud_loss_weight = rng.random()
        cfg = SimpleNamespace(train=train, model=SimpleNamespace(cloud_head="joint"))
        height = torch.from_numpy(out["height"][has])
        want = (
            train.height_loss_weight
            * float(F.huber_loss(height, torch.from_numpy(target[has]), delta=train.huber_delta))
            if has.any()
            else 0.0
        )
        logits, truth = torch.from_numpy(out["cloud_logit"]), torch.from_numpy(flags.astype(np.float64))
        want += train.cloud_loss_weight * float(F.binary_cross_entropy_with_logits(logits, truth))
        assert validation_loss(out, target, has, flags, cfg) == want
