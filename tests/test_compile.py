"""torch.compile really runs, on the CPU, with gradient checkpointing (the path of preset A).

These tests compile for real (inductor, a C++ compiler): the tiny test model's frame encoder, which
inductor then finds in its on-disk cache, so after the first compile of a session each costs a few
seconds. Tolerances (what "equal" means for compiled kernels):
  - compiled against eager, one step: gradients within rtol 1e-4 / atol 1e-5 (fused kernels sum in
    another order); BatchNorm running statistics within the same, updated once per step;
  - compiled against eager, a whole tiny run (14 optimizer steps): weights within atol 2e-3; the
    same between two compiled runs whose kernels were specialised to other batch shapes;
  - compiled, killed mid-epoch and resumed, against compiled uninterrupted: bit-identical (the same
    kernels on the same machine are deterministic; resume restores every state exactly);
  - a real compile failure: the run falls back to eager from the same step and ends bit-identical to
    an eager run (nothing counted twice).
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_cli, run_process

from cloudml_lib.base.config import build_config
from cloudml_lib.base.errors import ConfigError
from cloudml_lib.core.network.compile import apply_compile, cpu_ratio, describe_saved, plan
from cloudml_lib.core.network.model import MultimodalRegressionModel
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.status import format_status, run_status
from cloudml_lib.science.report import build_report_md
from cloudml_lib.train import Trainer

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("clang++") is None,
    reason="torch.compile on the CPU needs a C++ compiler (g++ or clang++); install one (apt install g++)",
)


def weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


def compiled_raw(raw: dict, setting=True) -> dict:
    raw = copy.deepcopy(raw)
    raw["model"]["gradient_checkpointing"] = True
    raw["train"]["torch_compile"] = setting
    # the format a compiled run takes (build.use_memory_format), so that its eager twin compares bit for bit
    raw["train"]["memory_format"] = "default"
    return raw


# ------------------------------------------------------------------------------ the model alone


@pytest.mark.slow
def test_a_compiled_checkpointed_step_matches_eager():
    """One training step of the tiny model: compiled encoder + checkpointing against plain eager."""
    torch.manual_seed(0)
    eager = MultimodalRegressionModel(channels=[4, 8, 8], dropout=0.0)
    eager.set_grad_checkpointing(True)
    compiled = copy.deepcopy(eager)
    watch = apply_compile(compiled, True, "default", CPU)
    frames, scalars = torch.randn(4, 3, 24, 32), torch.randn(4, 3)
    for m in (eager, compiled):
        m(frames, scalars).height.square().mean().backward()
    report = watch.update()
    assert report.active and report.graphs >= 1 and report.graph_breaks == 0, report
    assert list(compiled.state_dict()) == list(eager.state_dict())  # no _orig_mod. in saved keys
    for (name, pe), (_, pc) in zip(eager.named_parameters(), compiled.named_parameters()):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-5, msg=name)
    for (name, be), (_, bc) in zip(eager.named_buffers(), compiled.named_buffers()):
        torch.testing.assert_close(bc, be, rtol=1e-4, atol=1e-5, msg=name)  # running stats
        if name.endswith("num_batches_tracked"):
            assert bc.item() == frames.shape[1], (
                f"{name}: {bc.item()} updates; once per frame, none in the recomputation"
            )
    assert "1 graph(s), no graph break" in report.describe() or report.graphs > 1


def test_cuda_graph_modes_with_checkpointing_are_refused_by_config_and_by_compile():
    raw = {
        "data": {"demo": True},
        "model": {"gradient_checkpointing": True},
        "train": {"torch_compile": True, "torch_compile_mode": "reduce-overhead"},
    }
    with pytest.raises(ConfigError, match="static input data pointer changed"):
        build_config(raw)
    model = MultimodalRegressionModel(channels=[4, 8, 8])
    model.set_grad_checkpointing(True)
    with pytest.raises(ConfigError, match="'max-autotune' captures CUDA graphs"):
        apply_compile(model, True, "max-autotune", torch.device("cuda"))  # refused before any compiling
    assert "forward" not in vars(model.encoder)


def test_a_torch_too_old_to_compile_under_checkpointing_runs_eager_with_a_warning(monkeypatch, caplog):
    """pyproject.toml admits torch 2.3; compiling inside gradient checkpointing needs 2.10. On an older torch
    the model runs eager, the report says why, and a model without checkpointing still compiles."""
    monkeypatch.setattr(torch, "__version__", "2.8.0+cu126")
    monkeypatch.setattr(
        logging.getLogger("cloudml_lib"), "propagate", True
    )  # an earlier run may have stopped it
    model = MultimodalRegressionModel(channels=[4, 8, 8])
    model.set_grad_checkpointing(True)
    with caplog.at_level("WARNING", logger="cloudml_lib"):
        report = apply_compile(model, True, "default", CPU).update()
    assert not report.active and report.requested and "forward" not in vars(model.encoder)
    assert "torch 2.8.0+cu126 is older than 2.10" in report.describe() and "Not compiled" in caplog.text
    plain = MultimodalRegressionModel(channels=[4, 8, 8])
    assert apply_compile(plain, True, "default", CPU).report.active and "forward" in vars(plain.encoder)


def test_the_plan_in_words_states_what_compiling_measured_on_a_cpu():
    results = json.loads((REPO / "benchmarks" / "results" / "compile.json").read_text())
    full = results["full"]["region_ckpt"]
    assert f"{full['speed_vs_eager']:.2f}x for the full model" in cpu_ratio()
    assert f"after about {full['break_even_steps']:,} steps" in cpu_ratio()
    assert plan(True, "default", CPU) == f"on, on this CPU: the frame encoder ({cpu_ratio()})"
    assert plan(True, "default", torch.device("cuda")).startswith("on: the frame encoder, mode 'default'")
    assert plan(False, "default", CPU) == "off"


def test_old_runs_without_a_compile_record_are_described():
    assert describe_saved(None).startswith("not recorded")
    assert (
        describe_saved({"requested": False, "why": "train.torch_compile is off", "future_key": 1})
        == "not compiled (train.torch_compile is off)"
    )


# ------------------------------------------------------------------------------- the trainer


@pytest.mark.slow
def test_compiled_training_matches_eager_and_is_reported_everywhere(tiny_raw_config, tmp_path):
    compiled = Trainer(build_config(compiled_raw(tiny_raw_config)), tmp_path / "compiled").setup()
    compiled.fit()
    eager = Trainer(build_config(compiled_raw(tiny_raw_config, False)), tmp_path / "eager").setup()
    eager.fit()
    assert compiled.progress.step == eager.progress.step == 14
    diff = max_diff(weights(compiled.model), weights(eager.model))
    assert 0 < diff < 2e-3, f"compiled vs eager weights differ by {diff}"  # 0 would mean nothing compiled
    report = compiled.compile.report
    assert report.active and report.graphs >= 1 and report.graph_breaks == 0 and not report.fallback, report
    assert report.compile_s > 0
    info = json.loads((tmp_path / "compiled" / "run.json").read_text())["compile"]
    assert info["active"] and info["graphs"] == report.graphs and info["what"].startswith("the frame encoder")
    log = (tmp_path / "compiled" / "train.log").read_text()
    assert "torch.compile: compiled the frame encoder" in log and "no graph break" in log
    assert f"torch.compile on the CPU: {cpu_ratio()}" in log
    status = format_status(run_status(RunFolder(tmp_path / "compiled")))
    assert "torch.compile: compiled the frame encoder" in status
    md = build_report_md(RunFolder(tmp_path / "compiled"))
    assert "torch.compile: compiled the frame encoder" in md and "no graph break" in md
    assert "torch.compile: not compiled (train.torch_compile is off)" in format_status(
        run_status(RunFolder(tmp_path / "eager"))
    )


@pytest.mark.slow
def test_out_of_memory_with_a_compiled_model_recompiles_for_the_smaller_micro_batches(
    tiny_raw_config, tmp_path
):
    """The OOM comes after the compiled forward ran at full size (as in backward): the halved micro-batches
    are new shapes for the compiled encoder; it recompiles (or goes dynamic) and the run ends like a
    compiled run that used micro-batches of 2 from the start."""
    calls = []

    def oom_after_forward(forward):
        def f(frames, scalars):
            out = forward(frames, scalars)
            if torch.is_grad_enabled():
                calls.append(len(frames))
                if len(frames) > 2:
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected above 2)")
            return out

        return f

    raw = compiled_raw(tiny_raw_config)
    raw["train"]["batch_size"] = 8  # halved twice, to 4 then 2
    cfg = build_config(raw)
    injected = Trainer(cfg, tmp_path / "a").setup()
    injected.forward = oom_after_forward(injected.forward)
    injected.fit()
    reference = Trainer(cfg, tmp_path / "b").setup()
    reference.progress.micro_batch_size = 2
    reference.fit()
    assert calls[:3] == [8, 4, 2] and max(calls[3:]) <= 2
    assert injected.progress.oom_recoveries == 2
    assert injected.progress.step == reference.progress.step == injected.total_steps == 10
    report = injected.compile.update()
    assert report.active and not report.fallback and report.recompiles >= 1 and report.graph_breaks == 0, (
        report
    )
    # the two runs compiled different shape specialisations (8 then dynamic, against 2 then dynamic):
    # kernels that sum in another order, so the whole-run tolerance applies
    assert max_diff(weights(injected.model), weights(reference.model)) < 2e-3


# ------------------------------------------------------------------------- whole runs, in processes


@pytest.fixture
def cfg_file(tiny_raw_config, tmp_path):
    def write(setting=True, every_steps=4):
        raw = compiled_raw(tiny_raw_config, setting)
        raw["checkpoint"] = {"every_steps": every_steps}
        path = tmp_path / f"config_{setting}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    return write


def train(cfg: Path, run: Path, **env) -> subprocess.CompletedProcess:
    """A process of its own, as a new Colab VM: torch.compile's state (its compiled graphs, the C++ compiler
    it found, inductor's caches) is the process's, and what these tests are about."""
    return run_process("train", "--config", cfg, "--run-dir", run, env=env)


def best_weights(run: Path) -> dict:
    return torch.load(run / "best.pt", weights_only=True)["model"]


def last_weights(run: Path) -> dict:
    from cloudml_lib.core.run.checkpoint import find_checkpoints, load_state

    return load_state(find_checkpoints(RunFolder(run))[0] / "state.pt")["model"]


@pytest.mark.slow
def test_a_compiled_run_killed_mid_epoch_and_resumed_is_bit_identical(cfg_file, tmp_path):
    cfg = cfg_file()
    # each start on a machine of its own (a new Colab VM: an empty local inductor cache)
    first_vm, second_vm = str(tmp_path / "vm1"), str(tmp_path / "vm2")
    killed = train(cfg, tmp_path / "killed", CLOUDML_KILL_AT="step:10", CLOUDML_COMPILE_LOCAL=first_vm)
    assert killed.returncode != 0  # saved at step 8: epoch 2, batch 1
    assert "no compiled kernels kept yet" in killed.stdout  # a cold cache is said
    kept = tmp_path / "killed" / "compile_cache"
    assert any(p.is_file() for p in kept.rglob("*")), "the compiled kernels were not kept in the run folder"
    # the uninterrupted reference on the first machine, whose cache the killed run filled: the same kernels,
    # without compiling them a second time from nothing (the suite's time; a cache hit is what the resumed
    # run below is held to as well)
    assert train(cfg, tmp_path / "whole", CLOUDML_COMPILE_LOCAL=first_vm).returncode == 0
    resumed = train(cfg, tmp_path / "killed", CLOUDML_COMPILE_LOCAL=second_vm)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from step 8 (epoch 2, batch 1/7)" in resumed.stdout
    assert "torch.compile: compiled kernels kept from an earlier session" in resumed.stdout
    assert "torch.compile: compiled the frame encoder" in resumed.stdout
    info = json.loads((tmp_path / "killed" / "run.json").read_text())["compile"]
    assert info["cache_hits"] >= 1, info  # the new machine took the kept graphs instead of compiling them
    for get in (last_weights, best_weights):
        a, b = get(tmp_path / "whole"), get(tmp_path / "killed")
        assert max_diff(a, b) == 0.0, get.__name__


@pytest.mark.slow
def test_a_real_compile_failure_falls_back_to_eager_and_matches_an_eager_run(cfg_file, tmp_path):
    """No C++ compiler on PATH and an empty inductor cache: inductor really fails on the first step."""
    no_compiler = tmp_path / "bin"
    no_compiler.mkdir()
    with tempfile.TemporaryDirectory() as cache:
        failing = train(
            cfg_file(True), tmp_path / "failing", PATH=str(no_compiler), TORCHINDUCTOR_CACHE_DIR=cache
        )
    assert failing.returncode == 0, failing.stderr[-2000:]
    assert (
        "torch.compile failed (" in failing.stdout
        and "Continuing in eager mode from the same step" in failing.stdout
    )
    info = json.loads((tmp_path / "failing" / "run.json").read_text())["compile"]
    assert info["requested"] and not info["active"] and "compiler" in info["fallback"].lower(), info
    assert "not compiled: torch.compile failed" in format_status(run_status(RunFolder(tmp_path / "failing")))
    # the eager run compiles nothing: in this process, with the threads a new process would have
    assert run_cli("train", "--config", cfg_file(False), "--run-dir", tmp_path / "eager").returncode == 0
    assert max_diff(last_weights(tmp_path / "failing"), last_weights(tmp_path / "eager")) == 0.0


def test_the_local_kernel_folder_is_the_users_on_this_machine_shared_by_runs_and_kept_per_run(
    tmp_path, monkeypatch
):
    """compile_cache.py without compiling: one local folder per user and machine (a second run of the model
    compiles warm), each run's lasting folder gets what it lacks, and a new machine gets it back."""
    import os

    from cloudml_lib.core.network import compile_cache
    from cloudml_lib.core.network.compile_cache import INDUCTOR_ENV, LOCAL_ENV, CompileCache

    monkeypatch.setattr(
        os, "environ", {k: v for k, v in os.environ.items() if k not in (INDUCTOR_ENV, LOCAL_ENV)}
    )
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    run_a, run_b = tmp_path / "a" / "compile_cache", tmp_path / "b" / "compile_cache"
    first, second = CompileCache(run_a), CompileCache(run_b)
    assert (
        first.local == second.local == tmp_path / "tmp" / f"cloudml-compile-cache-{compile_cache.user_name()}"
    )
    assert "no compiled kernels kept yet" in first.open() and os.environ[INDUCTOR_ENV] == str(first.local)
    kernel = first.local / "fxgraph" / "ab" / "kernel.py"
    kernel.parent.mkdir(parents=True)
    kernel.write_text("compiled")
    (first.local / "fxgraph" / "ab" / "kernel.py.lock").write_text("")  # a lock file is never kept
    assert first.keep() == 1 and (run_a / "fxgraph" / "ab" / "kernel.py").read_text() == "compiled"
    assert first.keep() == 0  # nothing new
    assert "this machine holds 1 files compiled for earlier runs" in second.open()
    os.environ[LOCAL_ENV] = str(tmp_path / "new_vm")  # a new machine: its local folder is empty
    again = CompileCache(run_a)
    assert "kept from an earlier session: 1 files" in again.open() and again.brought == 1
    assert (tmp_path / "new_vm" / "fxgraph" / "ab" / "kernel.py").read_text() == "compiled"
    assert not list((tmp_path / "new_vm").rglob("*.lock")) and not list(run_a.rglob(".cloudml-partial-*"))
