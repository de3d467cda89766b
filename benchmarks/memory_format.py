"""Training in channels_last memory format against the default (contiguous), side by side, per device.

    python benchmarks/memory_format.py          # writes benchmarks/results/memory_format.json (~5 min, CPU)
    python benchmarks/memory_format.py --smoke  # tiny sizes: checks the code path, writes nothing

What the trainer follows (core/network/model.py `training_memory_format`): channels_last where this file says
it pays on the kind of device at hand (a median speed-up of at least 1.05 over every model measured), as
predict follows benchmarks/predict.py. Each model trains the one synthetic step (core/machine/memory.py: the
real network, AdamW, the run's precision) on random inputs; the two formats alternate round by round, so that
they meet the same machine load, after a warm-up step that is left out. Before training, the two formats'
outputs for the same weights and inputs are compared (they agree to float rounding).

Models (the frame reduced on the CPU, said in the results):
  demo  configs/demo.yaml's model (16/32/64, no checkpointing) on 64 x 96 frames
  C     preset C's model (32/64/128, checkpointing) on 110 x 160 frames on a CPU (440 x 640 on a GPU)
  B     preset B's model (64/128/256, checkpointing) on 110 x 160 frames on a CPU (440 x 640 on a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "memory_format.json"
# name: (channels, checkpointing, frame on a CPU, frame on a GPU, batch)
MODELS = {
    "demo": ((16, 32, 64), False, (64, 96), (64, 96), 16),
    "C": ((32, 64, 128), True, (110, 160), (440, 640), 16),
    "B": ((64, 128, 256), True, (110, 160), (440, 640), 16),
}
USE_AT = 1.05  # the median speed-up from which the trainer takes channels_last


def one_model(name: str, device, rounds: int, steps: int, smoke: bool) -> dict:
    """Steps/s of each format, alternated over `rounds` of `steps` steps, and their weights' difference."""
    import torch

    from cloudml_lib.core.machine import estimate
    from cloudml_lib.core.machine.device import choose_precision
    from cloudml_lib.core.machine.memory import synthetic_inputs, synthetic_step

    channels, ckpt, cpu_frame, gpu_frame, batch = MODELS[name]
    frame = (16, 24) if smoke else (gpu_frame if device.type == "cuda" else cpu_frame)
    batch = 2 if smoke else batch
    shape = estimate.StepShape(channels, ckpt, None, 5, *frame)
    precision = choose_precision(device)
    runs = {}
    for fmt in ("contiguous", "channels_last"):
        torch.manual_seed(0)
        model = estimate.model_of(shape).to(device).train()
        if fmt == "channels_last":
            model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
        step = synthetic_step(model, optimizer, precision.autocast(device), scaler)
        generator = torch.Generator(device=device).manual_seed(1)
        inputs = synthetic_inputs(model, batch, 5, *frame, device=device, generator=generator)
        runs[fmt] = {"model": model, "step": step, "inputs": inputs, "rates": []}
    heights = []
    for r in runs.values():  # the same weights and inputs: the outputs agree to float rounding
        r["model"].eval()
        with torch.no_grad(), precision.autocast(device)():
            heights.append(r["model"](*r["inputs"][:2]).height.float())
        r["model"].train()
    diff = float((heights[0] - heights[1]).abs().max())
    for r in runs.values():  # warm-up: first calls allocate and choose kernels
        r["step"](r["inputs"])
    for _ in range(rounds):
        for r in runs.values():
            t0 = time.perf_counter()
            for _ in range(steps):
                r["step"](r["inputs"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            r["rates"].append(steps / (time.perf_counter() - t0))
    ratios = [cl / co for co, cl in zip(runs["contiguous"]["rates"], runs["channels_last"]["rates"])]
    return {
        "frame": list(frame),
        "batch": batch,
        "checkpointing": ckpt,
        "channels": list(channels),
        "steps_per_s": {f: statistics.median(r["rates"]) for f, r in runs.items()},
        "speedup": statistics.median(ratios),
        "speedup_range": [min(ratios), max(ratios)],
        "max_output_difference": diff,
    }


def main(argv=None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes; writes nothing")
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()) if not torch.cuda.is_available() else 8)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    out = {"machine": machine(), "use_at": USE_AT, "channels_last": {}, "models": {}}
    rounds, steps = (2, 1) if args.smoke else (7, 3)
    for device in devices:
        per = {name: one_model(name, device, rounds, steps, args.smoke) for name in MODELS}
        out["models"][device.type] = per
        speedup = statistics.median(m["speedup"] for m in per.values())
        out["channels_last"][device.type] = {"speedup": speedup, "use": speedup >= USE_AT}
        for name, m in per.items():
            print(
                f"{device.type} {name}: {m['steps_per_s']['contiguous']:.2f} steps/s contiguous, "
                f"{m['steps_per_s']['channels_last']:.2f} channels_last: {m['speedup']:.2f}x "
                f"[{m['speedup_range'][0]:.2f}-{m['speedup_range'][1]:.2f}], outputs differ by "
                f"{m['max_output_difference']:.1e}"
            )
    if args.smoke:
        print(json.dumps(out["channels_last"]))
        return 0
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
