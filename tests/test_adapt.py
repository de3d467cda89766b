"""Adaptation to a new flight with a few of its labels (science/adapt.py, the API's `adapt`): the first N
labels in time adapt, only what follows a gap is scored, the same for every N; the scored labels move no
weight; the baselines and the intervals get the same N labels; a flight the run trained on is refused."""

import datetime as dt
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import cloudml_lib as cml
from cloudml_lib.base.config import derive
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.core.run.checkpoint import Key
from cloudml_lib.data.cache import load_flight_cache
from cloudml_lib.data.dataset import CloudDataset, Scalers
from cloudml_lib.data.preprocess import STAT_NAMES
from cloudml_lib.data.synthetic import make_demo_flights
from cloudml_lib.science import adapt
from cloudml_lib.science.evaluate import load_run_model
from cloudml_lib.science.predict import flights_to_predict


@pytest.fixture(scope="module")
def new_flight(shared_tiny_run, tmp_path_factory):
    """The session's tiny run's flights and a new, longer flight of another month beside them (a copy):
    (run, data dir, the new flight's name)."""
    run, data, _ = shared_tiny_run
    tmp = tmp_path_factory.mktemp("adapt")
    made = make_demo_flights(
        tmp / "made", n_flights=2, seed=9, frames_per_flight=600, frame_shape=(40, 48),
        dates=[dt.date(2025, 4, 1), dt.date(2025, 4, 3)],
    )  # fmt: skip
    flights = tmp / "flights"
    shutil.copytree(data, flights)
    shutil.copytree(tmp / "made" / made[0]["name"], flights / made[0]["name"])
    return run, flights, made[0]["name"]


@pytest.mark.slow
def test_a_new_flight_is_adapted_on_its_first_labels_and_scored_after_the_gap(new_flight):
    run, flights, name = new_flight
    got = cml.adapt(run, name, labels=[10, 25], data_dir=flights)
    assert got["role"] == "not one of this run's flights: never seen in training"
    assert [p["n"] for p in got["curve"]] == [0, 10, 25] and got["left_out"] == {}
    assert got["gap_frames"] >= adapt.GAP_FLOOR_FRAMES and "e-folding lag" in got["gap_from"]
    assert got["scored_labels"] >= adapt.MIN_SCORED
    assert {p["network"]["n"] for p in got["curve"]} == {got["scored_labels"]}  # the same labels for every N
    for point in got["curve"]:
        assert set(point["baselines"]) >= {"mean", "linear", "trees"}
        assert all(m["n"] == got["scored_labels"] for m in point["baselines"].values())
        assert point["against_best"]["call"] in ("better", "level", "worse")
        assert point["best_baseline"] == min(
            point["baselines"], key=lambda k: point["baselines"][k]["mae_km"]
        )
    first, ten, many = got["curve"]
    assert first["network"] != ten["network"] != many["network"]  # the head moved
    assert first["baselines"]["mean"] != ten["baselines"]["mean"]  # the training mean became the flight's own
    assert ten["intervals"]["calibrated_on"] == "the run's"  # 10 labels cannot calibrate an interval
    assert many["intervals"]["calibrated_on"] == "the run's and the first 25 labels' out-of-fold"
    assert 0 <= many["intervals"]["coverage"] <= 1 and many["intervals"]["target"] == 0.9
    words = "\n".join(got["words"])
    assert f"scored on its {got['scored_labels']} labels" in words and "N = 25: network MAE" in words
    assert "(calibrated on the run's and the first 25 labels' out-of-fold errors)" in words


@pytest.mark.slow
def test_the_runs_intervals_are_not_taken_for_other_weights(new_flight, tmp_path):
    """best.pt replaced after the run's end (put back from a backup): the run's calibration was made on the
    other weights' errors (intervals.json records whose), so no N takes it, as predict and evaluate."""
    import torch

    run, flights, name = new_flight
    other = shutil.copytree(run, tmp_path / "run")
    best = torch.load(other / "best.pt", weights_only=False)
    best["model"] = {k: v + 1e-3 if v.is_floating_point() else v for k, v in best["model"].items()}
    torch.save(best, other / "best.pt")
    first, ten = cml.adapt(other, name, labels=[10], data_dir=flights)["curve"]
    assert first["intervals"] is None and ten["intervals"] is None  # 10 labels calibrate none of their own


@pytest.mark.slow
def test_the_scored_labels_move_no_weight(new_flight):
    """The heads fine-tuned at each N are the same when the scored part's labels are shuffled, and not when
    an adaptation label changes: nothing is chosen or fitted on what is scored."""
    run, flights, name = new_flight
    rm = load_run_model(run, str(flights))
    cfg = derive(rm.cfg, {"data.dir": str(flights)})
    scalers = Scalers.from_dict(rm.ckpt[Key.SCALERS])
    cache = load_flight_cache(flights_to_predict(cfg, [name])[name], cfg.data)
    lab = adapt.labelled(rm.model, CloudDataset([cache], scalers, cloud=False), torch.device("cpu"), 64)
    gap = adapt.gap_frames(CloudDataset([cache], scalers, cloud=False))
    fitted = {"mean": np.full(lab.frames.size, scalers.cbh_mean)}
    settings = (cfg.train, 0, None, "conformal_absolute", 0.9)

    def heads(lab):
        record, heads = adapt.curve(rm.model, scalers, lab, fitted, [10, 25], gap, settings)
        return record, {n: [p.detach().clone() for p in h.parameters()] for n, h in heads.items() if h}

    record, before = heads(lab)
    start = lab.frames.size - record["scored_labels"]
    shuffled = np.concatenate(
        [np.arange(start), start + np.random.default_rng(0).permutation(lab.frames.size - start)]
    )
    moved = adapt.Labelled(lab.rows, lab.frames, lab.true_km[shuffled], lab.target[shuffled], lab.features)
    again, after = heads(moved)
    assert again["curve"][1]["network"] != record["curve"][1]["network"]  # the scores did change
    for n in (10, 25):
        assert all(torch.equal(a, b) for a, b in zip(before[n], after[n]))
    changed = lab.target.copy()
    changed[3] += 1.0  # one adaptation label
    _, other = heads(adapt.Labelled(lab.rows, lab.frames, lab.true_km, changed, lab.features))
    assert not all(torch.equal(a, b) for a, b in zip(before[10], other[10]))


def test_the_gap_is_the_brightness_e_folding_lag_with_a_floor():
    rng = np.random.default_rng(1)
    x = np.zeros(4000)
    for i in range(1, x.size):  # an AR(1) series of e-folding lag 1 / -ln(0.99), about 100 frames
        x[i] = 0.99 * x[i - 1] + rng.normal()
    stats = np.zeros((x.size, len(STAT_NAMES)))
    stats[:, STAT_NAMES.index("mean")] = x

    def flight(series):
        stats[:, STAT_NAMES.index("mean")] = series
        return SimpleNamespace(caches=[SimpleNamespace(frame_index=np.arange(x.size), frame_stats=stats)])

    gap, why = adapt.gap_frames(flight(x))
    assert 50 <= gap <= 200 and f"{gap} frames" in why
    gap, why = adapt.gap_frames(flight(rng.normal(size=x.size)))  # no memory: the floor
    assert gap == adapt.GAP_FLOOR_FRAMES and "raised to the floor" in why


def test_adapting_on_a_trained_flight_or_with_bad_labels_is_refused(tiny_run, capsys):
    """And the command on the tiny test flight (23 labels): each N said too many to score after a gap."""
    from cloudml_lib.commands.cli import main

    run, _, entries = tiny_run
    assert main(["adapt", "--run-dir", str(run), "--labels", "10"]) == 0
    out = capsys.readouterr().out
    assert f"{entries[2]['name']}: 10 left out: the flight has" in out and "fewer than 20 to score" in out
    assert main(["adapt", "--run-dir", str(run), "--flight", entries[0]["name"]]) == 2
    assert "is a training flight of this run" in capsys.readouterr().err
    with pytest.raises(
        CloudMLError, match=f"flight {entries[0]['name']} is a training flight.*never trained"
    ):
        cml.adapt(run, entries[0]["name"])
    with pytest.raises(ValueError, match=r"labels=\[0\]: expected counts of 1 or more"):
        cml.adapt(run, labels=[0])
    with pytest.raises(TypeError, match="flight=3: expected a flight's name"):
        cml.adapt(run, 3)
