"""Peak GPU memory of presets A, B, C at the real size under a T4-sized cap; speed of A against B;
the memory probe's prediction against the measurement.

    python benchmarks/gpu.py            # on a CUDA GPU; writes benchmarks/results/gpu.json
    python benchmarks/gpu.py --smoke    # on the CPU at a tiny size: checks the code path only, writes nothing

Each preset runs real training steps (forward, backward, AdamW step, with the preset's precision,
checkpointing and compile settings) on synthetic 440 x 640 x T=5 batches at its own batch size,
with the process capped to 14.7 GiB (`torch.cuda.set_per_process_memory_fraction`) to stand for a
T4. Steps/s are timed after warm-up (compilation included in warm-up), with CUDA synchronised.

Beside each measurement: the fake-tensor estimate of the same step (cloudml_lib/estimate.py) and the ratios
max_memory_allocated / estimated peak and memory_reserved / estimated peak, with what the GPU adds beyond
the tensors (reserved - estimated): the figures that calibrate the estimate's stated overhead. The same
estimate counts the step's FLOPs, so steps/s is also reported as a fraction of the GPU's peak rate (a T4:
65 TFLOPS fp16), the figure to push toward 35 %.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

T4_GIB = 14.7
# Dense fp16/bf16 tensor-core peak of GPUs this may run on (NVIDIA's data sheets), by a word of the name.
PEAK_FLOPS = {"T4": 65e12, "A100": 312e12, "L4": 121e12, "H100": 989e12, "H200": 989e12, "V100": 125e12}
PRESETS = {"A": "colab_optimized_full.yaml", "B": "colab_full_stable.yaml", "C": "colab_optimized.yaml"}


def build(preset: str, device: torch.device):
    from cloudml_lib.compile import apply_compile
    from cloudml_lib.config import load_config
    from cloudml_lib.hardware import choose_precision
    from cloudml_lib.model import build_model

    cfg = load_config(REPO / "configs" / PRESETS[preset])
    model = build_model(cfg).to(device)
    model.set_grad_checkpointing(cfg.model.gradient_checkpointing)
    watch = apply_compile(model, cfg.train.torch_compile, cfg.train.torch_compile_mode, device)
    forward = model  # the frame encoder inside is compiled in place when asked
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    p = choose_precision(device)
    autocast = (lambda: torch.autocast(device.type, dtype=p.dtype)) if p.dtype else nullcontext
    scaler = torch.amp.GradScaler(device.type, enabled=p.use_grad_scaler)
    return cfg, model, forward, opt, autocast, scaler, watch


def make_step(forward, opt, autocast, scaler, frames, scalars, target, train_cfg):
    from cloudml_lib.train import batch_loss

    def step():
        with autocast():
            pred = forward(frames, scalars)
        loss = batch_loss(pred, {"target": target}, train_cfg)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def measure_preset(preset: str, device: torch.device, shape, warmup: int, steps: int) -> dict:
    cfg, model, forward, opt, autocast, scaler, watch = build(preset, device)
    b, t = cfg.train.batch_size, cfg.data.temporal_frames
    gen = torch.Generator(device=device).manual_seed(0)
    frames = torch.randn(b, t, *shape, device=device, generator=gen)
    scalars = torch.randn(b, 3, device=device, generator=gen)
    target = torch.randn(b, device=device, generator=gen)
    step = make_step(forward, opt, autocast, scaler, frames, scalars, target, cfg.train)
    out = {
        "batch_size": b,
        "channels": cfg.channels,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
        "torch_compile": cfg.train.torch_compile,
    }
    try:
        for _ in range(warmup):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["steps_per_s"] = steps / (time.perf_counter() - t0)
        out["samples_per_s"] = out["steps_per_s"] * b
    except torch.cuda.OutOfMemoryError as e:
        out["out_of_memory"] = str(e).splitlines()[0]
    out["compile"] = watch.update().describe()
    out.update(against_estimate(cfg, device, shape, out))
    probe = probe_prediction(preset, device, shape)
    out["probe"] = probe
    if probe and "peak_allocated_gib" in out:
        out["probe"]["predicted_over_measured"] = probe["predicted_peak_gib"] / out["peak_allocated_gib"]
    del model, forward, opt, frames
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def against_estimate(cfg, device: torch.device, shape, measured: dict) -> dict:
    """The estimate of this preset's step at this size and precision, its ratios to the measurement, and the
    measured speed as a fraction of the GPU's peak FLOP rate."""
    from cloudml_lib.estimate import StepShape, estimate
    from cloudml_lib.hardware import choose_precision

    dtype = choose_precision(device).dtype
    amp = str(dtype).removeprefix("torch.") if dtype else None
    e = estimate(StepShape.of(cfg, amp, frame=tuple(shape)))
    if e is None:
        return {"estimate": "unavailable on this torch"}
    b = cfg.train.batch_size
    est = e.train_peak(b) / 2**30
    out = {"estimated_peak_gib": est, "estimated_tflop_per_step": e.flops_per_sample * b / 1e12}
    if "peak_allocated_gib" in measured:
        out["allocated_over_estimate"] = measured["peak_allocated_gib"] / est
        out["reserved_over_estimate"] = measured["peak_reserved_gib"] / est
        out["reserved_minus_estimate_gib"] = measured["peak_reserved_gib"] - est
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    if peak and "steps_per_s" in measured:
        out["fraction_of_peak_flops"] = measured["steps_per_s"] * e.flops_per_sample * b / peak
    return out


def probe_prediction(preset: str, device: torch.device, shape) -> dict | None:
    """What the batch-size probe predicts for this preset's batch (eager, as the probe runs)."""
    if device.type != "cuda":
        return None
    from cloudml_lib.memory import probe_batch_size

    cfg, model, _, opt, autocast, scaler, _ = build(preset, device)
    vars(model.encoder).pop("forward", None)  # the trainer's probe runs the eager model, before compiling
    t = cfg.data.temporal_frames

    def step(b):
        frames = torch.randn(b, t, *shape, device=device)
        make_step(
            model,
            opt,
            autocast,
            scaler,
            frames,
            torch.randn(b, 3, device=device),
            torch.randn(b, device=device),
            cfg.train,
        )()

    result = probe_batch_size(step, device, budget=int(T4_GIB * 2**30))
    model = opt = None
    torch.cuda.empty_cache()
    return {
        "recommended_batch": result.recommended,
        "predicted_peak_gib": result.predicted_peak(cfg.train.batch_size) / 2**30,
        "per_sample_gib": result.per_sample_bytes / 2**30,
        "fixed_gib": result.fixed_bytes / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--smoke", action="store_true", help="CPU, tiny frames: check the code path, write nothing"
    )
    args = p.parse_args()
    if args.smoke:
        device, shape, warmup, steps = torch.device("cpu"), (32, 40), 1, 1
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (use --smoke to check the code on the CPU)")
    else:
        device, shape, warmup, steps = torch.device("cuda"), (440, 640), 3, 10
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, T4_GIB / total))
    results = {name: measure_preset(name, device, shape, warmup, steps) for name in PRESETS}
    out = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (smoke)",
        "memory_cap_gib": T4_GIB if device.type == "cuda" else None,
        "frame": list(shape),
        "temporal_frames": 5,
        "torch": torch.__version__,
        "presets": results,
    }
    if "steps_per_s" in results["A"] and "steps_per_s" in results["B"]:
        out["A_over_B_samples_per_s"] = results["A"]["samples_per_s"] / results["B"]["samples_per_s"]
    print(json.dumps(out, indent=1))
    if not args.smoke:
        (REPO / "benchmarks" / "results" / "gpu.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
