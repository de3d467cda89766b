"""Three roles, never mixed (data/splits.py): the test flights are scored once and nothing is chosen on them;
validation data come from the training flights, by a stated rule that run.json records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from conftest import TINY_SHAPE, fit_and_finish, tiny_raw

from cloudml_lib.base.config import (
    LEGACY_VALIDATION,
    ConfigError,
    build_config,
    config_from_dict,
    load_config,
)
from cloudml_lib.data.cache import FlightCache
from cloudml_lib.data.splits import Block, choose_split, counts_by_role


def cache(name: str, frames: np.ndarray, heights: np.ndarray, t: int = 3) -> FlightCache:
    """A flight's cache of samples at `frames` with `heights` (NaN: a cloud flag only), for the split "
    "alone."""
    n = len(frames)
    return FlightCache(
        name=name,
        path=Path(name),
        frames=None,
        windows=np.asarray(frames)[:, None] + np.arange(t) - t // 2,
        frame_index=np.asarray(frames),
        cbh_km=np.asarray(heights, np.float32),
        cloud=np.isfinite(heights).astype(np.int8),
        layer_base_km=np.asarray(heights, np.float32),
        frame_p10=np.zeros(n),
        frame_stats=np.zeros((n, 10), np.float32),
        sza_deg=np.zeros(n),
        saa_deg=np.zeros(n),
        heading_deg=np.zeros(n),
        meta={},
    )


def flights(*counts: int) -> list[FlightCache]:
    """Flights named F0, F1, ... with the given number of height labels, one every 5 frames."""
    return [cache(f"F{i}", np.arange(k) * 5, np.linspace(0.2, 1.8, k)) for i, k in enumerate(counts)]


def data(cfg_data: dict):
    return build_config({"data": cfg_data}).data


def test_a_whole_training_flight_validates_the_one_nearest_the_median_count():
    caches = flights(501, 163, 144, 101, 24)  # the users' flights: 12Feb25 (144) the test flight
    split = choose_split(caches, data({"test_flights": ["F2"]}))
    # training counts 501, 163, 101, 24: median 132, and 163 and 101 are as near: the first of them
    assert split.rule == "flight" and split.validation == {"F1": None} and split.test == ("F2",)
    fit, val, test = split.parts(caches)
    assert [c.name for c in fit] == ["F0", "F3", "F4"] and [c.name for c in val] == ["F1"]
    assert [c.name for c in test] == ["F2"]
    record = split.record()
    assert record["validation"] == {"F1": "the whole flight"} and record["test_flights"] == ["F2"]
    assert "nearest the median" in record["why"]
    # an over-weighted flight trains; the rule takes another where it can
    assert choose_split(caches, data({"test_flights": ["F2"], "overweight_flight": "F1"})).validation == {
        "F3": None
    }


def test_with_fewer_than_three_training_flights_the_last_part_of_each_validates_after_a_gap():
    caches = flights(40, 40, 3)
    d = data({"test_flights": ["F1"], "validation_share": 0.25, "validation_gap_frames": 12})
    split = choose_split(caches, d)
    assert split.rule == "time_blocks"
    assert set(split.validation) == {"F0"}  # F2's 3 labels are too few for a block: it only trains
    block = split.validation["F0"]
    assert block == Block(first=150, end=196, gap=12, labels=10, of=40)  # the last 10 of 40 labels
    fit, val, _ = split.parts(caches)
    f0_fit, f0_val = fit[0], val[0]
    assert f0_val.frame_index.min() == 150 and f0_fit.frame_index.max() < 150 - 12
    # no frame is in a window of both roles: neighbouring frames would leak
    assert not set(f0_fit.windows.ravel()) & set(f0_val.windows.ravel())
    assert [c.name for c in fit] == ["F0", "F2"] and len(fit[1]) == 3


def test_named_validation_flights_and_the_rules_refusals():
    caches = flights(30, 30, 30, 30)
    split = choose_split(caches, data({"test_flights": ["F0"], "validation": ["F3"]}))
    assert split.rule == "named" and split.validation == {"F3": None}
    raw = {"data": {"flights": [], "test_flights": ["F0"], "validation": "flight"}}
    names = ["F0", "F1"]
    from cloudml_lib.base.config import check_flight_names

    cfg = build_config(raw).data
    said = check_flight_names(cfg, names)
    assert any("flight needs two training flights" in p and "time_blocks" in p for p in said)
    cfg = build_config({"data": {"test_flights": ["F0"], "validation": ["F0"]}}).data
    assert any(
        "is a test flight; nothing may be chosen on a test flight" in p
        for p in check_flight_names(cfg, names)
    )
    cfg = build_config({"data": {"test_flights": ["F0"], "validation": ["F1"]}}).data
    assert any("every training flight is a validation flight" in p for p in check_flight_names(cfg, names))
    with pytest.raises(ConfigError, match="no training flight has 5 or more height labels"):
        choose_split(flights(3, 30), data({"test_flights": ["F1"], "validation": "time_blocks"}))
    # a word no rule has: the valid ones named, never the word only an earlier release's runs may hold
    with pytest.raises(ConfigError) as refused:
        build_config({"data": {"validation": "bogus"}})
    said = str(refused.value)
    assert "'auto' or 'flight' or 'time_blocks'" in said and "test_flights" not in said


def test_the_picker_counts_the_roles_as_the_split_does():
    samples = {"F0": 501, "F1": 163, "F2": 144, "F3": 101, "F4": 24}
    train, val = counts_by_role(samples, data({"test_flights": ["F2"]}))
    assert (train, val) == (501 + 101 + 24, 163)
    train, val = counts_by_role({"F0": 50, "F1": 40}, data({"test_flights": ["F1"]}))
    assert (train, val) == (40, 10)  # time blocks: the last 20 % of F0


def test_the_old_key_means_the_test_flights_said_once_and_the_old_protocol_is_kept_for_old_runs(
    tmp_path, caplog
):
    path = tmp_path / "old.yaml"
    path.write_text("data:\n  validation_flights: [12Feb25]\n")
    with caplog.at_level("WARNING", logger="cloudml_lib.base.config"):
        cfg = load_config(path)
        load_config(path)
    assert cfg.data.test_flights == ["12Feb25"] and cfg.data.validation == "auto"
    notices = [r.getMessage() for r in caplog.records if "validation_flights is read as" in r.getMessage()]
    assert len(notices) <= 1  # once per process (an earlier test may have said it already)
    assert "validation_flights" not in cfg.to_dict()["data"]
    both = tmp_path / "both.yaml"
    both.write_text("data:\n  validation_flights: [A]\n  test_flights: [B]\n")
    with pytest.raises(ConfigError, match="earlier name of data.test_flights, and both are given"):
        load_config(both)
    # a new run cannot ask for selection on its test flights; a stored config of an earlier run keeps it
    legacy = tmp_path / "legacy.yaml"
    legacy.write_text("data:\n  validation: test_flights\n")
    with pytest.raises(ConfigError, match="kept for those runs to continue, never for a new one"):
        load_config(legacy)
    stored = {"data": {"validation_flights": ["12Feb25"]}, "model": {}}
    old = config_from_dict(stored)
    assert old.data.validation == LEGACY_VALIDATION and old.data.cloud_flag == "any_layer"
    assert old.data.test_flights == ["12Feb25"] and old.train.interval_calibration == "pooled"


def permute_labels(cpl_file: Path, seed: int = 0) -> None:
    """Every lidar profile's layers given to another profile of the same flight (the heights permuted among
    the frames)."""
    with h5py.File(cpl_file, "r+") as f:
        order = np.random.default_rng(seed).permutation(f["layer_descriptor/Number_Layers"].shape[0])
        for key in ("Layer_Base_Altitude", "Number_Layers"):
            d = f[f"layer_descriptor/{key}"]
            d[...] = d[...][order]


def tiny_trained(folder: Path, flights_dir: Path, entries, epochs: int = 3) -> dict:
    from cloudml_lib.train import Trainer

    raw = tiny_raw(flights_dir, entries, folder / "cache")
    raw["train"]["epochs"] = epochs
    return fit_and_finish(Trainer(build_config(raw), folder / "run").setup())


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory):
    """The tiny run on three longer tiny flights (about 60 labels each: enough to calibrate intervals on the
    validation blocks, and to tell no skill from chance on the test flight) twice, the second with its test
    flight's labels permuted among its frames: (first's folder, its report, second's folder, its report)."""
    from cloudml_lib.data.synthetic import make_demo_flights

    root = tmp_path_factory.mktemp("longer")
    entries = make_demo_flights(root, n_flights=3, seed=1, frames_per_flight=700, frame_shape=TINY_SHAPE)
    out = []
    for permuted in (False, True):
        tmp = tmp_path_factory.mktemp("permuted" if permuted else "original")
        shutil.copytree(root, tmp / "flights")
        if permuted:
            permute_labels(tmp / "flights" / entries[2]["cpl_file"])
        out += [tmp / "run", tiny_trained(tmp, tmp / "flights", entries)]
    return out


@pytest.mark.slow
def test_permuting_the_test_flights_labels_changes_nothing_but_the_test_scores(twin_runs):
    """What defines an untouched test flight: same seed and config, the test labels permuted, and the run
    trains to the same weights, chooses the same epoch, fits the same probe and calibrates the same
    intervals; only the test scores differ."""
    first, report, second, permuted = twin_runs
    a, b = (torch.load(r / "best.pt", weights_only=True) for r in (first, second))
    assert a["epoch"] == b["epoch"] and a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:  # the network and the cloud probe, bit for bit
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["split"] == b["split"] and a["label_range_km"] == b["label_range_km"]
    cal = [json.loads((r / "intervals.json").read_text()) for r in (first, second)]
    assert cal[0] == cal[1] and cal[0]["flights"] and not set(cal[0]["flights"]) & {"05Mar25"}
    histories = [
        [json.loads(line) for line in (r / "metrics.jsonl").read_text().splitlines()] for r in (first, second)
    ]
    epochs = [[(h["val_loss"], h["r2"]) for h in hs if h["kind"] == "epoch"] for hs in histories]
    assert epochs[0] == epochs[1]  # the validation score of every epoch: the same data
    assert report["per_flight"]["05Mar25"] != permuted["per_flight"]["05Mar25"]  # the test scores differ
    assert report["protocol"]["name"] == "untouched_test" and report["protocol"]["test_flights"] == [
        "05Mar25"
    ]


@pytest.mark.slow
def test_a_noise_test_flight_gets_no_positive_skill_and_is_called_so(twin_runs):
    """Selection on the test flight is how a model of no skill reports some: the permuted flight is noise,
    and the run, which chose nothing on it, reports no skill there and says so."""
    _, _, second, permuted = twin_runs
    noise = permuted["per_flight"]["05Mar25"]
    assert noise["n"] >= 50 and noise["r2"] < 0.05
    assert "not useful yet on 05Mar25" in permuted["verdict"]
    run = json.loads((second / "run.json").read_text())
    assert run["split"]["test_flights"] == ["05Mar25"] and run["split"]["rule"] == "time_blocks"
    history = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    losses = [h["val_loss"] for h in history if h["kind"] == "epoch"]
    assert permuted["best_epoch"] == int(np.argmin(losses)) + 1  # chosen on the validation data alone
    assert (
        "Test flights 05Mar25: scored once, at the end; nothing was chosen on them"
        in (second / "report.md").read_text()
    )
