"""torch.compile against eager, side by side: the demo model and the full 64/128/256 model.

    python benchmarks/compile.py           # writes benchmarks/results/compile.json
    python benchmarks/compile.py --smoke   # a tiny model, the region variant only: checks the code path

For each model, with and without gradient checkpointing, two ways of compiling the same training
step (forward, backward, AdamW step, on one fixed batch), each against eager:
  region   what CloudML does (cloudml_lib/core/network/compile.py): the frame encoder compiled in place, the
           checkpoint around it in eager mode;
  whole    torch.compile of the whole model, the checkpoint traced inside it (the alternative).
Each variant runs in its own process with an empty inductor cache, so its first compiled step pays
the whole cold compile, as on a fresh Colab runtime. Then eager and compiled steps alternate on the
same model (the compiled module is switched on and off, not compiled again), so the ratio is measured
side by side under the same load. Reported: median step of each (steps/s), speed against eager,
compile seconds (the first compiled step minus a warm one), the steps after which compiling has paid
for itself, the bytes autograd keeps for backward in one step, and Dynamo's graph and graph-break
counts.

With CUDA, the same on the GPU at the real frame size, plus each compile mode the config allows, with
and without checkpointing (CUDA-graph modes with checkpointing: the config's refusal is recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "compile.json"
# name: (config, frame rows x columns, batch, warm-up steps, timed steps) on a CPU
MODELS = {
    "demo": ("demo.yaml", (64, 96), 16, 2, 12),
    "full": ("colab_optimized_full.yaml", (110, 160), 4, 2, 8),
}
CUDA_FRAME = (440, 640)
VARIANTS = ("region", "whole")


def one(model_name: str, variant: str, ckpt: bool, mode: str, device_name: str, smoke: bool) -> dict:
    """Measure one compiled variant against eager in this process (a child process): the first compiled
    step (cold compile), then eager and compiled steps alternating on the same model, so both see the
    same machine load; the compiled module is switched on and off without compiling again."""
    import torch

    from cloudml_lib.base.config import load_config
    from cloudml_lib.core.network.compile import CompileReport, CompileWatch, apply_compile
    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.train import batch_loss

    torch.manual_seed(0)
    config, shape, batch, warmup, steps = MODELS[model_name]
    device = torch.device(device_name)
    if device.type == "cuda":
        shape = CUDA_FRAME
    if smoke:
        shape, batch, warmup, steps = (16, 24), 2, 1, 2
    cfg = load_config(REPO / "configs" / config)
    if smoke:
        cfg.model.channels = [4, 8, 8]
    model = build_model(cfg).to(device)
    model.set_grad_checkpointing(ckpt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    frames = torch.randn(batch, cfg.data.temporal_frames, *shape, generator=gen).to(device)
    scalars = torch.randn(batch, 3, generator=gen).to(device)
    target = torch.randn(batch, generator=gen).to(device)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16)
        if device.type == "cuda"
        else torch.autocast("cpu", enabled=False)
    )

    def step(forward, saved: list | None = None) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(
                lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t
            )
            if saved is not None
            else nullcontext()
        )
        with hooks, autocast:  # saved: count the bytes autograd keeps for backward
            loss = batch_loss(forward(frames, scalars), {"target": target}, cfg.train)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(warmup):
        step(model)
    if variant == "region":
        watch = apply_compile(model, True, mode, device)
        compiled_forward = model.encoder.forward

        def use(compiled: bool):
            if compiled:
                model.encoder.forward = compiled_forward
            else:
                vars(model.encoder).pop("forward", None)
            return model
    else:
        watch = CompileWatch(CompileReport(active=True))
        whole = torch.compile(model, mode=mode)

        def use(compiled: bool):
            return whole if compiled else model

    first = step(use(True))
    for _ in range(warmup):
        step(use(True))
    eager_s, compiled_s = [], []
    for _ in range(steps):  # alternating pairs
        eager_s.append(step(use(False)))
        compiled_s.append(step(use(True)))
    saved_eager, saved_compiled = [], []
    step(use(False), saved_eager)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    step(use(True), saved_compiled)
    report = watch.update()
    med_e, med_c = statistics.median(eager_s), statistics.median(compiled_s)
    out = {
        "eager_step_ms": med_e * 1e3,
        "step_ms": med_c * 1e3,
        "steps_per_s": 1 / med_c,
        "eager_steps_per_s": 1 / med_e,
        "speed_vs_eager": med_e / med_c,
        "pair_ratio_median": statistics.median(e / c for e, c in zip(eager_s, compiled_s)),
        "first_step_s": first,
        "compile_s": max(0.0, first - med_c),
        "saved_for_backward_mb": sum(saved_compiled) / 1e6,
        "eager_saved_for_backward_mb": sum(saved_eager) / 1e6,
        "graphs": report.graphs,
        "graph_breaks": report.graph_breaks,
        "break_reasons": report.break_reasons,
        "frame": list(shape),
        "batch": batch,
        "channels": list(cfg.channels),
        "pairs": steps,
    }
    gain_s = med_e - med_c
    out["break_even_steps"] = round(out["compile_s"] / gain_s) if gain_s > 0 else None
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def child(model_name: str, variant: str, ckpt: bool, mode: str, device: str, smoke: bool) -> dict:
    """One variant in a fresh process with an empty inductor cache (a cold compile)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        cmd = [sys.executable, __file__, "--child", model_name, variant, str(int(ckpt)), mode, device]
        r = subprocess.run(
            cmd + (["--smoke"] if smoke else []), cwd=REPO, env=env, capture_output=True, text=True
        )
    if r.returncode != 0:
        return {"failed": (r.stderr.strip().splitlines() or ["no message"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def cuda_modes(smoke: bool) -> dict:
    """Each compile mode the config allows, with and without checkpointing, on the full model (CUDA)."""
    from cloudml_lib.base.config import CUDA_GRAPH_COMPILE_MODES, ConfigError, load_config

    out = {}
    for mode in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        for ckpt in (True, False):
            key = f"{mode}_{'ckpt' if ckpt else 'nockpt'}"
            try:
                load_config(
                    REPO / "configs" / "colab_optimized_full.yaml",
                    [f"train.torch_compile_mode={mode}", f"model.gradient_checkpointing={str(ckpt).lower()}"],
                )
            except ConfigError as e:
                out[key] = {"refused_by_config": str(e).splitlines()[-1]}
                continue
            out[key] = child("full", "region", ckpt, mode, "cuda", smoke)
            print(key, json.dumps(out[key]), flush=True)
    assert all("refused_by_config" in out[f"{m}_ckpt"] for m in CUDA_GRAPH_COMPILE_MODES)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--smoke", action="store_true", help="tiny model, two steps: check the code path, write nothing"
    )
    p.add_argument(
        "--child", nargs=5, metavar=("MODEL", "VARIANT", "CKPT", "MODE", "DEVICE"), help=argparse.SUPPRESS
    )
    args = p.parse_args()
    if args.child:
        name, variant, ckpt, mode, device = args.child
        print(json.dumps(one(name, variant, ckpt == "1", mode, device, args.smoke)))
        return
    import torch

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out = {"machine": machine(), "inductor_cache": "empty for every variant (cold compile)"}
    models, ckpts, variants = (
        (["demo"], (True,), VARIANTS[:1]) if args.smoke else (MODELS, (True, False), VARIANTS)
    )
    for device in devices:
        for name in models:
            runs = {}
            for ckpt in ckpts:
                for variant in variants:
                    key = f"{variant}_{'ckpt' if ckpt else 'nockpt'}"
                    runs[key] = child(name, variant, ckpt, "default", device, args.smoke)
                    print(device, name, key, json.dumps(runs[key]), flush=True)
            out[name if device == "cpu" else f"cuda_{name}"] = runs
        if device == "cuda":
            out["cuda_modes"] = cuda_modes(args.smoke)
    print(json.dumps(out, indent=1))
    failed = [
        f"{m}.{k}: {v['failed']}"
        for m, runs in out.items()
        if isinstance(runs, dict)
        for k, v in runs.items()
        if isinstance(v, dict) and "failed" in v
    ]
    if failed:
        sys.exit("compile benchmark: some variants failed:\n" + "\n".join(failed))
    if not args.smoke:
        RESULTS.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
