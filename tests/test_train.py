import json
import math
import re

import numpy as np
import pytest
import torch
from conftest import fit_and_finish, run_cli, tiny_raw

from cloudml_lib.base.config import build_config
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.core.machine import device
from cloudml_lib.core.run.checkpoint import load_checkpoint
from cloudml_lib.train import Trainer, lr_factor, weighted_huber


@pytest.fixture(scope="module")
def finished_run(tiny_flights, tmp_path_factory):
    """One tiny training run shared by the tests that read its files."""
    root, entries = tiny_flights
    tmp = tmp_path_factory.mktemp("run")
    cfg = build_config(tiny_raw(root, entries, tmp / "cache"))
    trainer = Trainer(cfg, tmp / "run").setup()
    report = fit_and_finish(trainer)
    return trainer, report, tmp / "run"


def test_lr_follows_warmup_then_cosine_per_optimizer_step(tiny_config, tmp_path):
    tiny_config.train.warmup_steps = 4
    tiny_config.train.epochs = 3  # 21 steps: a warm-up of 4 fits (at most a fifth of the run)
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    assert trainer.progress.warmup_steps == 4
    base = tiny_config.train.learning_rate
    batches = iter(trainer.loader)
    for k in range(trainer.steps_per_epoch):
        expected = base * lr_factor(k, 4, trainer.total_steps, tiny_config.train.min_lr_ratio)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(expected)
        trainer.train_step(next(batches))
        trainer.optimizer_step()
    assert trainer.progress.step == trainer.steps_per_epoch == 7
    # warm-up reaches the peak after warmup_steps optimizer steps, not epochs
    assert lr_factor(0, 4, 100, 0.0) == 0.25 and lr_factor(3, 4, 100, 0.0) == 1.0
    assert lr_factor(100, 4, 100, 0.01) == pytest.approx(0.01)
    assert lr_factor(52, 4, 100, 0.0) == pytest.approx(0.5)


def test_a_warmup_longer_than_the_run_is_fitted_to_it_and_kept_across_resumes(tiny_config, tmp_path):
    from types import SimpleNamespace

    from cloudml_lib.core.run.progress import Progress
    from cloudml_lib.train.build import fitted_warmup, use_warmup

    # Auto's CPU try-out run: 12 optimizer steps under the presets' 200-step warm-up would never reach its LR
    assert fitted_warmup(200, 12) == 3 and fitted_warmup(200, 2000) == 200 and fitted_warmup(0, 12) == 0
    tiny_config.train.warmup_steps = 200
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    total = trainer.total_steps
    assert trainer.progress.warmup_steps == fitted_warmup(200, total) < total
    said = (tmp_path / "run" / "train.log").read_text()
    assert f"Warm-up: {fitted_warmup(200, total)} optimizer steps, not train.warmup_steps' 200" in said
    for _ in range(trainer.total_steps):  # the peak LR is reached inside the run
        trainer.scheduler.step()
        if trainer.optimizer.param_groups[0]["lr"] == pytest.approx(tiny_config.train.learning_rate):
            break
    else:
        raise AssertionError("the run never reached its learning rate")
    # a resumed run keeps the warm-up it started with; one saved before warm-ups were fitted, the config's
    parts = SimpleNamespace(warmup_steps=3, total_steps=12, scheduler=SimpleNamespace(lr_lambdas=[None]))
    kept = Progress(step=5, warmup_steps=7)
    use_warmup(parts, kept, tiny_config)
    assert kept.warmup_steps == 7 and parts.scheduler.lr_lambdas[0].keywords["warmup_steps"] == 7
    old = Progress(step=5)
    use_warmup(parts, old, tiny_config)
    assert old.warmup_steps == 200 and parts.scheduler.lr_lambdas[0].keywords["warmup_steps"] == 200
    with pytest.raises(CloudMLError, match="warmup_steps 'x'"):
        use_warmup(parts, Progress(step=5, warmup_steps="x"), tiny_config)


def test_run_directory_holds_every_promised_file(finished_run):
    _, _, run = finished_run
    for name in (
        "config.yaml",
        "train.log",
        "metrics.jsonl",
        "best.pt",
        "predictions.csv",
        "evaluation.json",
        "plots/curves.png",
        "plots/scatter.png",
    ):
        assert (run / name).is_file(), name


def test_console_and_log_lines(finished_run):
    _, _, run = finished_run
    log = (run / "train.log").read_text()
    pattern = (
        r"Epoch 2/2 \| train_loss \d+\.\d{3} \| val_loss \d+\.\d{3} \| R2 -?\d+\.\d{2} \| "
        r"MAE \d+\.\d{3} km \| lr \d\.\de-\d\d \| \d+\.\d s"
    )
    assert re.search(pattern, log), log
    assert "New best model saved (val_loss" in log
    assert "baseline (training mean)" in log


def test_metrics_jsonl_has_steps_epochs_and_final(finished_run):
    trainer, report, run = finished_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    assert kinds.count("epoch") == 2 and kinds[-1] == "final"
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == list(range(2, trainer.progress.step + 1, 2))
    for r in steps:  # the LR logged after step k is the schedule's value for step k
        t = trainer.cfg.train
        assert r["lr"] == pytest.approx(
            t.learning_rate
            * lr_factor(r["step"], trainer.progress.warmup_steps, trainer.total_steps, t.min_lr_ratio)
        )
        assert r["samples_per_s"] > 0 and math.isfinite(r["loss"])
    assert records[-1]["r2"] == report["overall"]["r2"]


def test_best_checkpoint_is_plain_and_loads_weights_only(finished_run):
    trainer, report, run = finished_run
    ckpt = torch.load(run / "best.pt", weights_only=True)
    assert not any(k.startswith("_orig_mod") for k in ckpt["model"])
    assert set(ckpt["model"]) == set(trainer.model.state_dict())
    assert ckpt["config"]["train"]["epochs"] == 2
    # the azimuth: sine, cosine; the brightness statistics: one offset and one scale in the file's units
    radiometry = {"radiometry_offset", "radiometry_scale", "radiometry_units"}
    assert set(ckpt["scalers"]) == {"sza_mean", "sza_std", "cbh_mean", "cbh_std"} | radiometry
    assert ckpt["scalers"]["radiometry_units"] == "K" and ckpt["scalers"]["radiometry_scale"] > 0
    assert ckpt["epoch"] == report["best_epoch"] >= 1


def test_predictions_and_report_are_in_km(finished_run):
    trainer, report, run = finished_run
    lines = (run / "predictions.csv").read_text().splitlines()
    assert lines[0] == "flight,frame_index,true_km,pred_km,cpl_cloud,cloud_probability"
    # every matched frame of the test flight: its rows, none of the training flights' (validation) ones
    assert len(lines) - 1 == report["cloud"]["model"]["overall"]["n"] > len(trainer.val_set)
    assert {line.split(",")[0] for line in lines[1:]} == set(trainer.cfg.data.test_flights)
    true = np.array([float(x.split(",")[2]) for x in lines[1:] if x.split(",")[2]])
    assert len(true) == report["overall"]["n"] < len(lines) - 1  # rows with only a cloud flag too
    assert 0.1 <= true.min() and true.max() <= 2.0
    prob = np.array([float(x.split(",")[5]) for x in lines[1:]])
    assert ((prob >= 0) & (prob <= 1)).all()
    assert report["baseline"]["r2"] <= 0.0 + 1e-9 or report["baseline"]["std_ratio"] < 1e-6
    assert set(report["per_flight"]) == set(trainer.cfg.data.test_flights)


def test_existing_run_directory_is_not_overwritten(finished_run, tiny_config):
    _, _, run = finished_run
    before = (run / "best.pt").read_bytes()
    with pytest.raises(CloudMLError, match="already holds a run and --resume never refuses to touch it"):
        Trainer(tiny_config, run, resume="never").setup()
    assert (run / "best.pt").read_bytes() == before


def test_gradient_accumulation_counts_optimizer_steps(tiny_config, tmp_path):
    tiny_config.train.epochs = 1
    tiny_config.train.grad_accum_steps = 3
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    n_batches = trainer.sampler.batches_per_epoch()
    trainer.train_epoch(0)
    assert trainer.progress.step == math.ceil(n_batches / 3) == trainer.steps_per_epoch


def test_overweighted_flight_counts_more_in_the_loss(tiny_raw_config, tmp_path):
    name = tiny_raw_config["data"]["flights"][0]["name"]
    tiny_raw_config["data"].update(overweight_flight=name, overweight_factor=3.0)
    trainer = Trainer(build_config(tiny_raw_config), tmp_path / "run").setup()
    weights = {
        trainer.train_set.identity(i)[0]: float(trainer.train_set[i]["weight"])
        for i in range(len(trainer.train_set))
    }
    assert weights[name] == 3.0 and sorted(weights.values()) == [1.0, 3.0]


def test_weighted_huber():
    pred, target = torch.tensor([0.0, 0.0]), torch.tensor([0.5, 3.0])
    plain = weighted_huber(pred, target, torch.ones(2), 1.0, 0.0)
    assert plain.item() == pytest.approx((0.125 + 2.5) / 2)
    weighted = weighted_huber(pred, target, torch.tensor([1.0, 3.0]), 1.0, 0.0)
    assert weighted.item() == pytest.approx((0.125 + 3 * 2.5) / 4)
    hard = weighted_huber(pred, target, torch.ones(2), 1.0, 1.0)
    assert hard.item() > plain.item()  # the large error weighs more


def test_precision_is_chosen_by_device(monkeypatch):
    assert device.choose_precision(torch.device("cpu")) == device.Precision(None, False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5))  # T4
    p = device.choose_precision(torch.device("cuda"))
    assert p.dtype == torch.float16 and p.use_grad_scaler and p.name == "fp16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))  # A100
    p = device.choose_precision(torch.device("cuda"))
    assert p.dtype == torch.bfloat16 and not p.use_grad_scaler


def test_asking_for_cuda_without_a_gpu_is_explained(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CloudMLError, match="train.device: 'cuda' was asked for but no CUDA GPU"):
        device.choose_device("cuda")


@pytest.mark.slow
def test_two_phase_protocol_pretrains_then_fine_tunes_and_resumes_exactly(tiny_raw_config, tmp_path):
    import signal

    import yaml

    raw = tiny_raw_config
    first = raw["data"]["flights"][0]["name"]
    raw["train"].update(pretrain_flight=first, pretrain_epochs=1, epochs=2)
    raw["data"]["overweight_factor"] = 2.0
    raw["checkpoint"] = {"every_steps": 2}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))

    def run(run_dir, kill_at=None):
        env = {"CLOUDML_KILL_AT": kill_at} if kill_at else None
        return run_cli("train", "--config", cfg, "--run-dir", run_dir, env=env)

    ref = tmp_path / "ref"
    r = run(ref)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"Phase 1 of 2: pre-training on {first}" in r.stdout and "Starting from the weights of" in r.stdout
    pre = yaml.safe_load((ref / "pretrain" / "config.yaml").read_text())
    assert [f["name"] for f in pre["data"]["flights"]] == [first, raw["data"]["test_flights"][0]]
    assert yaml.safe_load((ref / "config.yaml").read_text())["data"]["overweight_flight"] == first
    killed = tmp_path / "killed"
    assert run(killed, kill_at="step:7").returncode == -signal.SIGKILL  # phase 2 (phase 1 has 3 steps)
    r = run(killed)
    assert r.returncode == 0 and "Resumed from step" in r.stdout, r.stderr[-2000:]
    a = load_checkpoint(ref / "best.pt")["model"]
    b = load_checkpoint(killed / "best.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)  # as if never interrupted


def test_the_epochs_last_batch_merged_into_the_one_before_is_one_pass(tiny_config, tmp_path):
    """34 samples in batches of 11: the one left over joins the third batch, which is one pass of 12, never a
    micro-batch of one sample (BatchNorm over one sample is what the merge avoids; a run on one process then
    differs from the same run on two, tests/test_distributed.py)."""
    tiny_config.train.batch_size = 11
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    sizes, real = [], trainer.forward
    trainer.forward = lambda frames, scalars: (sizes.append(len(frames)), real(frames, scalars))[1]
    trainer.train_epoch(0)
    assert len(trainer.train_set) == 34 and sizes == [11, 11, 12]


def test_the_memory_format_is_chosen_by_measurement_and_kept_for_the_runs_life(
    tiny_config, tmp_path, monkeypatch
):
    from types import SimpleNamespace

    from cloudml_lib.base.config import derive
    from cloudml_lib.core.machine.distributed import Dist
    from cloudml_lib.core.network.model import training_memory_format
    from cloudml_lib.core.run.checkpoint import Key
    from cloudml_lib.train import build

    use, why = training_memory_format(torch.device("cpu"))  # the committed measurement decides
    assert isinstance(use, bool) and "benchmarks/results/memory_format.json" in why
    assert why.startswith(("channels_last;", "the default")) and "memory format" not in why  # said once
    monkeypatch.setattr(build, "training_memory_format", lambda device: (True, "channels_last memory format"))
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and trainer.progress.channels_last
    trainer.train_step(next(iter(trainer.loader)))  # trains in that format
    trainer.optimizer_step()
    assert trainer.progress.step == 1 and all(torch.isfinite(p).all() for p in trainer.model.parameters())
    # a resumed run keeps the format it started with, whatever is measured now; an older run, the default
    monkeypatch.setattr(build, "training_memory_format", lambda device: (False, "the default memory format"))
    for saved, expected in ((True, True), (False, False), (None, False)):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
        parts = SimpleNamespace(model=model, device=torch.device("cpu"), channels_last=None)
        loop = {} if saved is None else {"channels_last": saved}
        build.use_memory_format(parts, SimpleNamespace(state={Key.LOOP: loop}), Dist(), tiny_config)
        assert parts.channels_last is expected
        assert model[0].weight.is_contiguous(memory_format=torch.channels_last) is expected
    # a new compiled run keeps the default format, even where eager steps were measured faster in the other
    monkeypatch.setattr(build, "training_memory_format", lambda device: (True, "channels_last memory format"))
    compiled = derive(tiny_config, {"train.torch_compile": True})
    parts = SimpleNamespace(model=torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), channels_last=None)
    build.use_memory_format(parts, None, Dist(), compiled)
    assert parts.channels_last is False
    # the setting forces it; a config saved before the setting existed means the default format
    tiny_config.train.memory_format = "default"
    parts = SimpleNamespace(model=torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)), channels_last=None)
    build.use_memory_format(parts, None, Dist(), tiny_config)
    assert parts.channels_last is False
    from cloudml_lib.base.config import absent_settings

    assert {"train.memory_format": "default", "train.warmup_fit": False}.items() <= absent_settings(
        {"data": {}, "model": {}, "train": {}}
    ).items()
