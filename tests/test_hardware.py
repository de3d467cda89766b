import json

import pytest
import torch
from conftest import run_cli

from cloudml_lib.base.errors import ConfigError
from cloudml_lib.commands import presets
from cloudml_lib.core.machine import device, memory

GIB = presets.GIB
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_batch_size_fit_from_two_points():
    # peak = 1 GiB + 0.5 GiB per sample; budget 14.7 GiB; 15% margin -> (14.7/1.15 - 1)/0.5 = 23.57
    r = memory.fit_batch_size((2, 4), (int(2 * GIB), int(3 * GIB)), int(14.7 * GIB))
    assert r.fixed_bytes == pytest.approx(GIB) and r.per_sample_bytes == pytest.approx(0.5 * GIB)
    assert r.recommended == 23
    assert r.predicted_peak(23) * 1.15 <= 14.7 * GIB < r.predicted_peak(24) * 1.15
    assert "largest batch that fits is 23" in r.describe()


def test_probe_measures_two_steps_and_never_recommends_zero():
    seen = []

    def fake_measure(step, b, device):
        seen.append(b)
        return int((3 + 2 * b) * GIB)

    r = memory.probe_batch_size(
        lambda b: None, torch.device("cpu"), measure=fake_measure, budget=int(4 * GIB)
    )
    assert seen == [2, 4] and r.recommended == 1


def report(gpu=None, compile_ok=True, colab=True):
    return {
        "gpu": gpu,
        "compile": {
            "available": compile_ok,
            "reason": "available" if compile_ok else "Triton is not installed",
        },
        "colab": colab,
        "cpus": 2,
        "host_memory": {"total": 13 * GIB, "available": 11 * GIB},
        "disk_free": {},
    }


def t4(free_gib):
    return {
        "name": "Tesla T4",
        "compute_capability": "7.5",
        "total_bytes": int(15.6 * GIB),
        "free_bytes": int(free_gib * GIB),
        "processes": [],
    }


def test_preset_choice_by_gpu():
    """By the estimate of each preset's memory (tests/test_estimate.py checks the thresholds)."""
    assert presets.choose_preset(report(None))[0] == "demo"
    name, why = presets.choose_preset(report(t4(14.6)))
    assert name == "A" and "Tesla T4 has 14.6 GiB free" in why
    name, why = presets.choose_preset(report(t4(14.6), compile_ok=False))
    assert name == "B" and "torch.compile is not available (Triton is not installed)" in why
    name, why = presets.choose_preset(report(t4(3.5)))
    assert name == "C" and "Tesla T4 has 3.5 GiB free: the full model does not fit" in why


def test_recommendations_in_plain_words():
    gpu = t4(3.5)
    gpu["processes"] = [{"pid": 999999, "name": "python3", "used_mib": 5000}]
    lines = presets.recommendations(dict(report(gpu), disk_free={"cache": GIB}), cache_bytes=int(20e9))
    text = "\n".join(lines)
    assert "Preset: C" in text
    assert "1 other process(es) hold 5000 MiB of GPU memory (999999)" in text
    assert "DataLoader workers: 0 (Colab" in text
    assert "larger than 80% of the free RAM" in text
    assert "Only 1.0 GiB free on the disk of the cache folder" in text


def test_preset_files_resolve_and_unknown_names_are_explained():
    assert presets.preset_config_path("A").name == "colab_optimized_full.yaml"
    with pytest.raises(ConfigError, match="choose one of auto, A, B, C, demo, published"):
        presets.preset_config_path("D")


def test_colab_is_detected_from_its_environment(monkeypatch):
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-20261101")
    assert device.is_colab() and device.default_num_workers() == 0
    monkeypatch.delenv("COLAB_RELEASE_TAG")
    assert device.is_colab() is False


def test_diagnose_on_this_machine():
    r = run_cli("diagnose", "--json", "--config", "configs/demo.yaml")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"colab", "python", "torch", "gpu", "host_memory", "cpus", "disk_free", "recommendations"} <= set(
        out
    )
    assert out["host_memory"]["total"] > 0 and out["cpus"] >= 1
    assert set(out["disk_free"]) == {"data", "cache"}
    if out["gpu"] is None:
        assert out["recommendations"][0].startswith("Preset: demo")
    text = run_cli("diagnose").stdout
    assert "Host RAM:" in text and "Recommendations:" in text


def test_memory_readings_on_cpu():
    m = device.memory_readings(torch.device("cpu"))
    assert m["peak_rss_gib"] > 0.05
    assert device.format_memory(m).startswith("peak RSS ")
    assert (
        device.format_memory({"peak_allocated_gib": 9.1, "peak_reserved_gib": 10.2, "alloc_retries": 0})
        == "GPU peak 9.1/10.2 GiB alloc/reserved, 0 retries"
    )


def test_free_gpu_memory_says_what_it_did():
    assert device.release_gpu_memory().startswith("No GPU" if not torch.cuda.is_available() else "Released")


@pytest.mark.gpu
@needs_gpu
def test_probe_on_a_real_gpu(tiny_config, tmp_path):
    from cloudml_lib.train import Trainer

    tiny_config.train.batch_size = "auto"
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    trainer.close()
    # the measured batch is the run's plan (trainer.cfg); the config as loaded is never changed
    assert isinstance(trainer.cfg.train.batch_size, int) and trainer.cfg.train.batch_size >= 1
    assert tiny_config.train.batch_size == "auto"
    assert (
        "train.batch_size auto: memory probe: one step takes" in (tmp_path / "run" / "train.log").read_text()
    )


def test_batch_size_auto_on_cpu_uses_a_stated_default(tiny_config, tmp_path):
    from cloudml_lib.core.machine.memory import CPU_AUTO_BATCH
    from cloudml_lib.train import Trainer

    tiny_config.train.batch_size = "auto"
    tiny_config.train.device = "cpu"  # on a GPU machine too (this failed there before it was set)
    trainer = Trainer(tiny_config, tmp_path / "run").setup()
    trainer.close()
    assert trainer.cfg.train.batch_size == CPU_AUTO_BATCH and tiny_config.train.batch_size == "auto"
    assert "measuring needs a GPU; using 16 on the CPU" in (tmp_path / "run" / "train.log").read_text()


def test_the_deterministic_switch_sets_torchs_flags_and_says_what_it_costs():
    import os

    from cloudml_lib.core.machine.determinism import CUBLAS_ENV, apply_determinism, reset_determinism

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert "rounding, not bit for bit" in apply_determinism(False, cuda)
    assert not torch.are_deterministic_algorithms_enabled()  # off touches nothing
    try:
        words = apply_determinism(True, cuda)
        assert (
            torch.are_deterministic_algorithms_enabled()
            and torch.is_deterministic_algorithms_warn_only_enabled()
        )
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert os.environ[CUBLAS_ENV] == ":4096:8"
        assert "bit for bit" in words and "slower" in words
        assert "changes nothing" in apply_determinism(True, cpu)
    finally:
        reset_determinism()
        os.environ.pop(CUBLAS_ENV, None)
    assert not torch.are_deterministic_algorithms_enabled()
