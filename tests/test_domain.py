"""The domain check (data/domain.py): a flight's inputs against those of the samples the model was trained on,
frame by frame, in predict's files and evaluate's report; a run made before it says it cannot check."""

import shutil

import h5py
import numpy as np
import pytest

from cloudml_lib.data.domain import MIN_DISTANCE, Domain, inputs_of, names_of, recorded

RNG = np.random.default_rng(7)


def training_inputs(n=300, sea=293.0):
    """Three flights' worth of inputs: the sun, ten brightness statistics (K) and two predictors."""
    sza, az = RNG.uniform(20, 50, n), RNG.uniform(0, 360, n)
    stats = RNG.normal(285, 3, (n, 10))
    atmosphere = np.stack([RNG.normal(sea, 1, n), RNG.normal(sea - 1, 1, n)], 1)
    return sza, az, stats, atmosphere


def fitted():
    names, units = names_of("K", ["sea_surface_temperature", "t2m"])
    sza, az, stats, atm = training_inputs()
    return Domain.fit(inputs_of(sza, az, stats, atm), names, units, ["a", "b", "c"]), (sza, az, stats, atm)


def test_the_training_samples_are_inside_and_a_warmer_sea_is_named_frame_by_frame():
    domain, (sza, az, stats, atm) = fitted()
    assert not domain.judge(inputs_of(sza, az, stats, atm)).outside.any()  # by construction
    warm = atm.copy()
    warm[:40, 0] = atm[:, 0].max() + 3.0  # the first 40 frames' sea 3 K warmer than any training flight's
    judged = domain.judge(inputs_of(sza[:80], az[:80], stats[:80], warm[:80]))
    np.testing.assert_array_equal(judged.outside, np.arange(80) < 40)
    k = domain.names.index("sea_surface_temperature")
    assert (judged.beyond[:40, k] == 1).all() and not judged.beyond[40:].any()
    words = domain.words("X", judged)
    assert words.startswith("flight X: 40 of its 80 frames (50%) lie outside the inputs of the 3 training")
    assert domain.words("X", judged, "heights").startswith("flight X: 40 of its 80 heights (50%) come from")
    assert "its sea's surface temperature is warmer than any training flight's at 40 of them" in words
    assert words.endswith("so heights there are an extrapolation")
    cold = domain.judge(inputs_of(sza[:5], az[:5], stats[:5] - 30.0, atm[:5]))
    assert cold.outside.all() and "colder than any training flight's" in domain.words("Y", cold)


def test_a_combination_never_seen_is_outside_by_its_distance_though_each_input_is_in_range():
    names, units = names_of(None, ["sea_surface_temperature", "t2m"])
    n = 400
    sea = RNG.normal(293, 2, n)
    air = sea - 1 + RNG.normal(0, 0.1, n)  # the air follows the sea closely in training
    domain = Domain.fit(
        inputs_of(np.full(n, 30.0), np.zeros(n), None, np.stack([sea, air], 1)), names, units, ["a"]
    )
    odd = inputs_of([30.0], [0.0], None, [[295.0, 291.0]])  # each inside its range, the pair never seen
    judged = domain.judge(odd)
    assert judged.outside.all() and not judged.beyond.any() and judged.distance[0] > domain.threshold
    assert "the inputs together lie farther from the training samples than any" in domain.words("Z", judged)


def test_a_missing_input_is_not_judged_and_the_record_reads_back_checked():
    domain, (sza, az, stats, atm) = fitted()
    gone = atm[:3].copy()
    gone[:, :] = np.nan  # no position: no atmosphere at these frames
    assert not domain.judge(inputs_of(np.full(3, np.nan), az[:3], stats[:3], gone)).outside.any()
    back, why = recorded(domain.to_dict())
    assert why == "" and back.names == domain.names
    x = inputs_of(sza[:20], az[:20], stats[:20] + 9, atm[:20])
    np.testing.assert_array_equal(back.judge(x).distance, domain.judge(x).distance)
    assert recorded(None)[0] is None and "made before CloudML recorded them" in recorded(None)[1]
    bad = domain.to_dict()
    bad["precision"] = bad["precision"][:-1]
    found, why = recorded(bad)
    assert found is None and "precision matrix is not 15 x 15" in why
    # training samples all alike (their distances 0): a threshold of at least MIN_DISTANCE, a record that
    # reads back (a threshold of 0 once read as damaged)
    alike = Domain.fit(np.ones((5, 3)), ["a", "b", "c"], ["1", "1", "1"], ["f"])
    assert alike.threshold == MIN_DISTANCE and recorded(alike.to_dict())[1] == ""


def shifted_flight(data: str, entries: list, name: str, dest, kelvin: float):
    """A copy of flight `name`'s files under `dest`, its IR frames `kelvin` warmer (the counts shifted)."""
    entry = next(e for e in entries if e["name"] == name)
    for key in ("ir_file", "cpl_file", "nav_file"):
        (dest / entry[key]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(data / entry[key], dest / entry[key])
    with h5py.File(dest / entry["ir_file"], "r+") as f:
        frames = f["Product/Signal"]  # counts of 0.01 K above 180 K
        frames[...] = frames[...] + int(round(kelvin / float(frames.attrs["scale_factor"])))
    return dest


@pytest.mark.slow
def test_predict_flags_the_frames_of_a_warmer_flight_and_says_so_where_a_training_flight_is_inside(
    tiny_run, tmp_path
):
    import cloudml_lib as cml

    run, data, entries = tiny_run
    trained = entries[0]["name"]  # the flight the tiny run trained on (the others validate and test)
    warm = shifted_flight(data, entries, trained, tmp_path / "warm", 5.0)
    a = cml.predict_flight(run, trained)
    b = cml.predict_flight(run, trained, data_dir=warm)
    qc_a, qc_b = a["cloud_base_height_qc"].values, b["cloud_base_height_qc"].values
    assert 4 in list(b["cloud_base_height_qc"].attrs["flag_values"])
    assert b["cloud_base_height_qc"].attrs["flag_meanings"].split()[4] == "inputs_outside_training"
    heights = np.isfinite(b["cloud_base_height"].values)
    assert heights.any() and (qc_b[heights] >= 3).all()  # every height of the warm flight: 4, or 3 outside
    assert (qc_b == 4).any()  # the span of the labels (which keeps its 3)
    assert (b["input_distance"].values[heights] > b.attrs["input_distance_threshold"]).all()
    said = b.attrs["inputs_vs_training"]
    assert "brightness percentile is warmer than any training flight's" in said, said
    assert "so heights there are an extrapolation" in said
    # the flight trained on: its frames lie among the training samples (a few between labels may not)
    inside = (qc_a[np.isfinite(a["cloud_base_height"].values)] != 4).mean()
    assert inside > 0.9, a.attrs["inputs_vs_training"]
    assert a.attrs["model_test_skill"].startswith(f"not measured on this flight: {trained}")
    assert entries[2]["name"] in a.attrs["model_test_skill_other_flights"]


@pytest.mark.slow
@pytest.mark.parametrize("record", ["absent", "damaged"])
def test_a_run_without_the_record_predicts_and_says_it_cannot_check(tiny_run_copy, tmp_path, record):
    import torch

    import cloudml_lib as cml
    from cloudml_lib.core.run.checkpoint import Key

    run, _, entries = tiny_run_copy
    best = torch.load(run / "best.pt", weights_only=False)
    if record == "absent":
        best.pop(Key.DOMAIN)
    else:
        best[Key.DOMAIN]["threshold"] = "far"
    torch.save(best, run / "best.pt")
    ds = cml.predict_flight(run)
    said = ds.attrs["inputs_vs_training"]
    assert "input_distance" not in ds and not (ds["cloud_base_height_qc"].values == 4).any()
    want = "made before CloudML recorded them" if record == "absent" else "record of them is damaged"
    assert said.startswith(f"flight {entries[2]['name']}: its inputs cannot be compared") and want in said
