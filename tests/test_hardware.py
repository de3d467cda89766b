import json
import re

import pytest
import torch
from conftest import REPO, run_cli

from cloudml_lib.base.errors import ConfigError
from cloudml_lib.colab import drive
from cloudml_lib.commands import cli, presets
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


@pytest.mark.slow
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


def test_a_cuda_build_newer_than_the_driver_is_said_with_the_way_back():
    problem = device.torch_build_problem
    on_colab = problem("2.12.0+cu130", "13.0", "12.4", colab=True)  # `pip install -U torch` on Colab
    assert "torch 2.12.0+cu130 is built for CUDA 13.0" in on_colab and "supports CUDA up to 12.4" in on_colab
    assert "cannot use the GPU" in on_colab and "Restart session keeps the torch" in on_colab
    assert "Disconnect and delete runtime" in on_colab
    assert "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu128" in on_colab
    elsewhere = problem("2.12.0+cu130", "13.0", "12.4")
    assert "built for CUDA 12.4 or older" in elsewhere and "pytorch.org/get-started/locally/" in elsewhere
    assert "Colab" not in elsewhere
    assert problem("2.12.0", "12.9", "12.4", gpu_visible=False) is not None  # a newer minor, and no GPU
    assert problem("2.12.0", "12.9", "12.4") is None  # a newer minor often runs (minor-version compatibility)
    assert problem("2.12.0", "13.0", "12.4", gpu_visible=True) is None  # the GPU works: nothing to say
    for driver in ("12.8", "12.9", "13.0"):  # the driver as new as the build, or newer
        assert problem("2.11.0+cu128", "12.8", driver, gpu_visible=False) is None
    for built, driver in (("12.8", None), (None, None), ("12.8", "?"), ("x", "12.4")):  # unknowns
        assert problem("2.11.0", built, driver) is None
    assert "a CPU-only build" in problem("2.11.0+cpu", None, None, driver_present=True)
    driverless = problem("2.11.0", "12.8", None, driver_present=True, gpu_visible=False)
    assert "finds no GPU although an NVIDIA driver is installed" in driverless


def test_the_way_back_on_colab_names_the_torch_of_the_colab_twin():
    pins = (REPO / "constraints" / "colab.txt").read_text()
    release, build = device.COLAB_TORCH.split("+")
    assert re.search(rf"^torch=={re.escape(release)}$", pins, re.M) and f"torch {device.COLAB_TORCH}" in pins


def test_diagnose_and_the_notebook_say_why_the_gpu_is_unusable(monkeypatch, capsys):
    monkeypatch.setattr(presets, "driver_cuda_version", lambda: "12.4")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab-20261101")
    assert cli.main(["diagnose"]) == 0
    out = capsys.readouterr().out
    said = re.search(r"^GPU unusable: torch \S+ is built for CUDA 13\.0, .* up to 12\.4: .*$", out, re.M)
    assert said and "Disconnect and delete runtime" in said.group(0), out
    assert "(the driver's: up to 12.4)" in out
    assert cli.main(["diagnose", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["driver_cuda"] == "12.4" and "CUDA 13.0" in report["torch_build_problem"]
    drive.show_environment()  # the setup notebook's environment cell (format_machine, as show_diagnostics)
    shown = capsys.readouterr().out
    assert "GPU unusable: torch" in shown and "Change runtime type > T4 GPU" not in shown  # a GPU is there


def test_the_driver_check_reads_unknown_without_a_driver_and_never_raises():
    driver = device.driver_cuda_version()
    assert driver is None or re.fullmatch(r"\d+\.\d+", driver)
    if not device.nvidia_driver_present():
        assert driver is None and device.torch_build_notice() is None


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

    from cloudml_lib.core.machine.determinism import (
        CUBLAS_ENV,
        apply_determinism,
        reset_determinism,
        restore_determinism,
    )

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
        # the next run of the process (a notebook's kernel) with the switch off gets torch's switches back
        assert apply_determinism(False, cpu) == "off (on the CPU a run is deterministic anyway)"
        assert not torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.deterministic
        assert CUBLAS_ENV not in os.environ
        # the end of a run (Trainer.close) puts them back too, as they were before it
        torch.backends.cudnn.benchmark = True
        apply_determinism(True, cpu)
        restore_determinism()
        assert not torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = False
        # switches the user set in the process before any run are theirs: left on, and said
        torch.use_deterministic_algorithms(True)
        said = apply_determinism(False, cuda)
        assert torch.are_deterministic_algorithms_enabled() and "left on" in said, said
        restore_determinism()
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        reset_determinism()
        torch.backends.cudnn.benchmark = False
        os.environ.pop(CUBLAS_ENV, None)
    assert not torch.are_deterministic_algorithms_enabled()


def test_on_a_t4_compiling_is_offered_with_its_caveat_in_plain_words(monkeypatch):
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (7, 5))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else None)
    ok, why = device.compile_available()
    assert ok and "compute capability 8.0 and up" in why and "7.5" in why and "falls back to eager" in why
    gpu = {"name": "Tesla T4", "free_bytes": 14 * 2**30, "total_bytes": 15 * 2**30}
    name, reason = presets.choose_preset({"gpu": gpu, "compile": {"available": ok, "reason": why}})
    assert name == "A" and "torch.compile is available, with a caveat" in reason
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (8, 0))
    assert device.compile_available() == (True, "available")
