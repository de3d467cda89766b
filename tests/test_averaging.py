"""The moving average of the weights (train/averaging.py, train.ema_decay): what a run validates, keeps as
best.pt and saves in every checkpoint; a run made before the setting keeps its raw weights."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import fit_and_finish

from cloudml_lib.base.config import build_config, config_from_dict
from cloudml_lib.core.network.model import MultimodalRegressionModel
from cloudml_lib.core.run.checkpoint import Key, load_checkpoint
from cloudml_lib.train.averaging import WeightAverage, resolve_decay


def test_auto_averages_over_a_tenth_of_the_run_within_its_bounds():
    assert resolve_decay("auto", 360) == pytest.approx(1 - 1 / 36)  # the demo: 12 epochs of 30 steps
    assert resolve_decay("auto", 12) == pytest.approx(0.9)  # a short run: at least 10 steps
    assert resolve_decay("auto", 10**6) == pytest.approx(1 - 1 / 2000)
    assert resolve_decay(0.99, 10) == 0.99 and resolve_decay(0.0, 10) == 0.0


def test_the_average_starts_as_a_copy_then_follows_the_weights_and_restores_exactly():
    torch.manual_seed(0)
    model = MultimodalRegressionModel(channels=[4, 4, 4])
    average = WeightAverage(model, 0.5)
    with torch.no_grad():
        model.film[0].weight.fill_(1.0)
    average.update(model)  # the first: a copy
    assert torch.equal(average.module.film[0].weight, model.film[0].weight)
    with torch.no_grad():
        model.film[0].weight.fill_(3.0)
    average.update(model)  # warmed up: the second update's decay is min(0.5, 2 / 11)
    d = 2 / 11
    assert torch.allclose(
        average.module.film[0].weight, torch.full_like(model.film[0].weight, d + 3 * (1 - d))
    )
    assert average.decay_after(0) == 0.1 and average.decay_after(100) == 0.5  # then the full decay
    saved = average.state_dict()
    again = WeightAverage(MultimodalRegressionModel(channels=[4, 4, 4]), 0.5)
    again.load_state_dict(saved)
    assert saved["n_averaged"] == 2 and int(again.averaged.n_averaged) == 2
    for k, v in again.module.state_dict().items():
        assert torch.equal(v, average.module.state_dict()[k]), k


@pytest.mark.slow
def test_a_run_validates_and_keeps_the_average_and_checkpoints_it(tiny_raw_config, tmp_path):
    from cloudml_lib.train import Trainer

    report = fit_and_finish(Trainer(build_config(tiny_raw_config), tmp_path / "run").setup())
    final = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[-1]
    state = load_checkpoint(final / "state.pt")
    steps = state[Key.LOOP]["step"]
    assert state[Key.EMA]["n_averaged"] == steps > 0 and 0.8 < state[Key.EMA]["decay"] < 1.0
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    raw, averaged = state[Key.MODEL], state[Key.EMA]["weights"]
    assert not torch.equal(raw["film.0.weight"], averaged["film.0.weight"])  # two sets of weights
    if best[Key.EPOCH] == state[Key.LOOP]["epoch"]:  # the last epoch was the best: best.pt is the average
        assert torch.equal(best[Key.MODEL]["film.0.weight"], averaged["film.0.weight"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert "weights averaged (EMA, decay" in log and report["overall"]["n"] > 0
    epochs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "epoch" for r in epochs) == 2


def test_runs_made_before_the_settings_keep_their_raw_weights_and_the_per_frame_reading(tiny_config):
    stored = tiny_config.to_dict()
    del stored["train"]["ema_decay"], stored["data"]["radiometry"]
    old = config_from_dict(stored)
    assert old.train.ema_decay == 0.0 and old.data.radiometry == "none"
    assert (tiny_config.train.ema_decay, tiny_config.data.radiometry) == ("auto", "statistics")
