"""What CloudML's CUDA paths do on a real GPU, made to stand for a Colab T4, in one prepared run of a few
minutes (issue 46). Each item runs in a process of its own, time-boxed, and the results file is rewritten
after each item, so that a time-out still brings back what was measured:

    python benchmarks/gpu.py                      # on a CUDA GPU: writes benchmarks/results/gpu.json
    python benchmarks/gpu.py --results OUT.json   # the same, the results elsewhere (a lent machine's $OUT)
    python benchmarks/gpu.py --only memory,resume # some items again, merged into the existing results
    python benchmarks/gpu.py --smoke              # on the CPU at a tiny size: checks the code paths only

Standing for a T4: the process is capped at 14.7 GiB (`torch.cuda.set_per_process_memory_fraction`) and
every step runs in fp16 with a GradScaler (the library would choose bf16 on an A100/H100/H200; the script
replaces `choose_precision`). What transfers to a T4: memory under the cap (the same kernels' allocations,
mostly); speed, time to compile and the allocator's overhead do not transfer directly (a T4 has about 1/15
of an H100's fp16 rate and 1/10 of its memory bandwidth). Items, in this order, at 440 x 640 frames, T = 5:

  presets    A, B, C at their batch sizes on synthetic tensors: peak allocated / reserved against the
             fake-tensor estimate (estimate.py), reserved - estimate (the measured overhead beside the
             stated 0.75 GiB + 10 %), time to the first step, steps/s after warm-up, that as a fraction
             of the GPU's peak FLOP rate; preset A also eager, for compile's gain on the same batch
  compile    preset A (checkpointing, compile "default") through the real Trainer for 3 epochs of synthetic
             flights in the real file layout, then the same eager: graphs, recompiles, breaks and fall-backs
             after each epoch (validation passes included), steps/s of each
  precision  fp16 + GradScaler against fp32, preset C, same seed and batches: losses, non-finite losses,
             steps the scaler skipped
  memory     the batch probe's choice (memory.py) against the largest batch that really fits under the cap
             (presets A and B, eager as the probe runs); then the real Trainer under a lower cap: a training
             out-of-memory recovered by halving the micro-batch (same effective batch, same optimizer steps),
             an out-of-memory in evaluation shrinking only its batch
  predict    whole flights, each frame encoded once (inference.py), frames/s with and without channels_last,
             extrapolated to a 12,000-frame flight
  resume     one run killed by SIGKILL after a checkpoint and resumed, against the same run uninterrupted,
             with deterministic algorithms set by this script: equal bit for bit, or the largest difference
Then the items a T4 projection needs (issue 53: context, profile, speed, epoch, predict_2cpu, graphs), written
in gpu_t4.py; `--only t4` runs them alone, in one call of under 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def in_repo(text: str) -> str:
    """Output as the results file keeps it: paths relative to the repository, never the machine's."""
    return text.replace(f"{REPO}/", "")


sys.path.insert(0, str(REPO))

from benchmarks.gpu_t4 import ITEM_FUNCTIONS, NEEDS_CUDA, T4_BOX, T4_ITEMS  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "gpu.json"
SCRATCH = REPO / "benchmarks" / ".scratch" / "gpu"
T4_GIB = 14.7
OOM_CAP_GIB = 6.0  # the lower cap under which the Trainer's out-of-memory recoveries are forced
# Dense fp16/bf16 tensor-core peak of GPUs this may run on (NVIDIA's data sheets), by a word of the name.
PEAK_FLOPS = {"T4": 65e12, "A100": 312e12, "L4": 121e12, "H100": 989e12, "H200": 989e12, "V100": 125e12}
PRESETS = {"A": "colab_optimized_full.yaml", "B": "colab_full_stable.yaml", "C": "colab_optimized.yaml"}
# the items of issue 46, then those a T4 projection needs (gpu_t4.py: `--only t4` runs them in one call)
ITEMS = ("presets", "compile", "precision", "memory", "predict", "resume", *T4_ITEMS)
GROUPS = {"t4": T4_ITEMS}
# seconds each item may take on the GPU (the smoke run on a CPU gets 4x)
TIME_BOX = {"presets": 120, "compile": 120, "precision": 100, "memory": 75, "predict": 40, "resume": 130}
TIME_BOX.update(T4_BOX)
FLIGHTS, TEST = ("01Mar25", "03Mar25", "05Mar25"), "05Mar25"


class Size:
    """The sizes of a run: the real ones on a GPU, tiny ones for --smoke on a CPU."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        # the camera's rows x columns, and the rows kept; the smoke's frames are 32 x 48 (the demo camera's
        # rows, half its columns), which keeps each item's CPU run to seconds
        self.raw = (80, 48) if smoke else (512, 640)
        self.swath = (8, 40) if smoke else (40, 480)
        self.frame = (self.swath[1] - self.swath[0], self.raw[1])  # 440 x 640 on the GPU
        self.flight_frames = 160 if smoke else 500
        self.warmup, self.steps = (1, 2) if smoke else (3, 10)
        self.precision_steps = 6 if smoke else 300
        self.device = "cpu" if smoke else "cuda"

    def workers(self) -> int:
        """Loader processes: 4 on the GPU machine where shared memory can hold their batches, else none."""
        try:
            shm = shutil.disk_usage("/dev/shm").free
        except OSError:
            shm = 0
        return 0 if self.smoke or shm < 16 * 2**30 else 4

    def data_overrides(self, data_dir: Path, cache: Path) -> list[str]:
        return [
            f"data.dir={data_dir}",
            "data.flights=[]",
            f"data.cache_dir={cache}",
            "data.cache_copy_dir=",
            f"data.test_flights=[{TEST}]",
            # the CPU smoke's flights are short: a minute's gap before each validation block would leave
            # too few samples for the presets' batches
            f"data.validation_gap_frames={6 if self.smoke else 60}",
            f"data.swath_slice=[{self.swath[0]}, {self.swath[1]}]",
            f"data.num_workers={self.workers()}",
            "train.early_stopping_patience=0",
            "train.quick_val_fraction=1.0",
            f"train.device={self.device}",
        ]


# ------------------------------------------------------------------------------ standing for a T4


def stand_for_t4(cap_gib: float = T4_GIB) -> dict:
    """fp16 + GradScaler wherever the library chooses a precision, and the process capped at `cap_gib` (CUDA
    only). Returns what was set, for the results."""
    import torch

    import cloudml_lib.core.machine.device
    import cloudml_lib.science.evaluate
    import cloudml_lib.train.build
    from cloudml_lib.core.machine.device import Precision

    def fp16(device):
        return Precision(torch.float16, True) if device.type == "cuda" else Precision(None, False)

    for module in (cloudml_lib.core.machine.device, cloudml_lib.train.build, cloudml_lib.science.evaluate):
        module.choose_precision = fp16
    if not torch.cuda.is_available():
        return {"precision": "fp32 (CPU)", "memory_cap_gib": None}
    set_cap(cap_gib)
    return {"precision": "fp16 + GradScaler (forced, as on a T4)", "memory_cap_gib": cap_gib}


def set_cap(cap_gib: float) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib / total))


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_flops() -> float | None:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_FLOPS.items() if k in name), None)


def config(preset: str, size: Size, extra: list[str] = ()):
    from cloudml_lib.base.config import load_config

    overrides = size.data_overrides(SCRATCH / "flights", SCRATCH / "cache") + list(extra)
    return load_config(REPO / "configs" / PRESETS[preset], overrides)


# ------------------------------------------------------------------------------ item: presets


def build(cfg, device, compile_: bool | None = None):
    """The preset's model (its checkpointing, its compile unless `compile_` says), AdamW, autocast, scaler."""
    import torch

    from cloudml_lib.core.machine.device import choose_precision
    from cloudml_lib.core.network.compile import apply_compile
    from cloudml_lib.core.network.model import build_model

    model = build_model(cfg).to(device)
    model.set_grad_checkpointing(cfg.model.gradient_checkpointing)
    on = cfg.train.torch_compile if compile_ is None else compile_
    watch = apply_compile(model, on, cfg.train.torch_compile_mode, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    p = choose_precision(device)
    autocast = lambda: torch.autocast(device.type, dtype=p.dtype, enabled=p.dtype is not None)  # noqa: E731
    return model, opt, autocast, torch.amp.GradScaler(device.type, enabled=p.use_grad_scaler), watch


def training_step(model, opt, autocast, scaler, batch, train_cfg):
    """One real step (forward, loss, backward, AdamW, scaler); returns the loss and whether it was applied."""
    from cloudml_lib.train.loss import batch_loss

    with autocast():
        out = model(batch["frames"], batch["scalars"])
    loss = batch_loss(out, {"target": batch["target"]}, train_cfg)
    scaler.scale(loss).backward()
    scale = scaler.get_scale() if scaler.is_enabled() else 1.0
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    applied = not scaler.is_enabled() or scaler.get_scale() >= scale
    return loss.detach(), applied


def synthetic_batch(b: int, t: int, frame, device, seed: int = 0, scalars: int = 3) -> dict:
    """Frames, scalars (the angles; with data.radiometry the brightness statistics too: `scalars` of them) and
    a target that depends on the frames (so that a loss can fall)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    frames = torch.randn(b, t, *frame, generator=gen)
    target = frames[:, :, ::8, ::8].mean(dim=(1, 2, 3)) * 20
    return {"frames": frames.to(device), "scalars": torch.randn(b, scalars, generator=gen).to(device),
            "target": target.to(device)}  # fmt: skip


def n_scalars(model) -> int:
    """The scalar inputs a model takes (the compiled or plain module's FiLM input)."""
    from cloudml_lib.core.network.compile import unwrap_model

    return unwrap_model(model).film[0].in_features


def time_steps(step, size: Size) -> dict:
    """Time to the first step (compile included), then steps/s after warm-up, with peak memory."""
    import torch

    t0 = time.perf_counter()
    step()
    sync()
    out = {"first_step_s": time.perf_counter() - t0}
    for _ in range(size.warmup - 1):
        step()
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(size.steps):
        step()
    sync()
    out["steps_per_s"] = size.steps / (time.perf_counter() - t0)
    if torch.cuda.is_available():
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def measure_preset(name: str, size: Size, compile_: bool | None = None) -> dict:
    import torch

    cfg = config(name, size)
    device = torch.device(size.device)
    t0 = time.perf_counter()
    model, opt, autocast, scaler, watch = build(cfg, device, compile_)
    b = cfg.train.batch_size
    batch = synthetic_batch(b, cfg.data.temporal_frames, size.frame, device, scalars=n_scalars(model))
    built = time.perf_counter() - t0
    out = {
        "batch_size": b,
        "channels": cfg.channels,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
    }
    out["torch_compile"] = cfg.train.torch_compile if compile_ is None else compile_
    try:
        out.update(time_steps(lambda: training_step(model, opt, autocast, scaler, batch, cfg.train), size))
        out["time_to_first_step_s"] = built + out.pop("first_step_s")
        out["samples_per_s"] = out["steps_per_s"] * b
    except torch.cuda.OutOfMemoryError as e:
        out["out_of_memory"] = str(e).splitlines()[0][:200]
    out["compile"] = watch.update().describe()
    out.update(against_estimate(cfg, size, out))
    model = opt = batch = None
    release()
    return out


def release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def against_estimate(cfg, size: Size, measured: dict) -> dict:
    """The estimate of this preset's step (fp16 on a GPU), its ratios to the measurement, and the measured
    speed as a fraction of the GPU's peak FLOP rate."""
    from cloudml_lib.core.machine.estimate import OVERHEAD_BYTES, SLACK, StepShape, estimate

    e = estimate(StepShape.of(cfg, None if size.smoke else "float16", frame=size.frame))
    if e is None:
        return {"estimate": "unavailable on this torch"}
    b = cfg.train.batch_size
    est = e.train_peak(b) / 2**30
    out = {"estimated_peak_gib": est, "estimated_tflop_per_step": e.flops_per_sample * b / 1e12}
    out["stated_overhead_gib"] = OVERHEAD_BYTES / 2**30 + SLACK * est  # 0.75 GiB + 10 % of the peak
    out["estimated_need_gib"] = e.need(b) / 2**30  # what the preset choice budgets for
    if "peak_allocated_gib" in measured:
        out["allocated_over_estimate"] = measured["peak_allocated_gib"] / est
        out["reserved_over_estimate"] = measured["peak_reserved_gib"] / est
        out["reserved_minus_estimate_gib"] = measured["peak_reserved_gib"] - est
    peak = peak_flops()
    if peak and "steps_per_s" in measured:
        out["fraction_of_peak_flops"] = measured["steps_per_s"] * e.flops_per_sample * b / peak
    return out


def item_presets(size: Size, put) -> None:
    for name in PRESETS:
        # the CPU smoke compiles none: the compile item runs the compile's path (a cold inductor compile of
        # a preset's graph here as well took 37 s of the suite's CPU for nothing the compile item misses);
        # the GPU run compiles each preset its config compiles, and measures A eager beside it
        put(name, measure_preset(name, size, compile_=False if size.smoke else None))
    if not size.smoke:
        put("A_eager", measure_preset("A", size, compile_=False))


# ------------------------------------------------------------------------------ flights for the Trainer


def make_flights(size: Size) -> None:
    """Three synthetic flights in the real file layout (data/synthetic.py), written in parallel, once."""
    from concurrent.futures import ProcessPoolExecutor

    folder = SCRATCH / "flights"
    if (folder / "done").exists():
        return
    shutil.rmtree(folder, ignore_errors=True)
    with ProcessPoolExecutor(len(FLIGHTS)) as pool:
        list(pool.map(write_flight, [(folder, i, size.flight_frames, size.raw) for i in range(len(FLIGHTS))]))
    (folder / "done").write_text("")


def write_flight(args) -> None:
    import numpy as np

    from cloudml_lib.data import synthetic

    folder, i, frames, (rows, cols) = args
    entries, names = synthetic.demo_flight_entries(len(FLIGHTS)), synthetic.demo_flight_names(len(FLIGHTS))
    folder.mkdir(parents=True, exist_ok=True)
    synthetic._write_flight(
        folder, entries[i], names[i][1], i, np.random.default_rng([3, i]), frames, (rows, cols)
    )
    (folder / synthetic.VERSION_FILE).write_text(f"{synthetic.DEMO_VERSION}\n")


def trainer(cfg, run_dir: Path):
    """The real Trainer, set up in this process (its log to stdout)."""
    from cloudml_lib.base.logs import attach_run_log
    from cloudml_lib.train.loop import Trainer

    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own scratch run
    attach_run_log(None, console=sys.stdout)
    return Trainer(cfg, run_dir, resume="never").setup()


def timed_epochs(tr, per_epoch: list) -> None:
    """Wrap the trainer's train_epoch: its seconds (synchronised) and optimizer steps, epoch by epoch."""
    inner = tr.train_epoch

    def train_epoch(epoch):
        step0, t0 = tr.progress.step, time.perf_counter()
        loss = inner(epoch)
        sync()
        per_epoch.append(
            {"epoch": epoch + 1, "train_s": time.perf_counter() - t0, "steps": tr.progress.step - step0}
        )
        return loss

    tr.train_epoch = train_epoch


# ------------------------------------------------------------------------------ item: compile


def trainer_run(preset: str, size: Size, run: str, extra: list[str]) -> dict:
    """A whole run of the real Trainer; the compile report after every epoch (validation passes included)."""
    import torch

    tr = trainer(config(preset, size, extra), SCRATCH / run)
    per_epoch, reports = [], []
    timed_epochs(tr, per_epoch)
    t0 = time.perf_counter()
    tr.fit(
        after_epoch=lambda history: reports.append(dict(tr.compile.update().to_dict(), epoch=len(history)))
    )
    out = {"epochs": per_epoch, "compile_after_each_epoch": reports, "wall_s": time.perf_counter() - t0}
    out["compile_at_end"] = tr.compile.update().to_dict()
    out["compile_at_end_text"] = tr.compile.report.describe()
    later = per_epoch[1:] or per_epoch
    out["steps_per_s_after_epoch_1"] = sum(e["steps"] for e in later) / sum(e["train_s"] for e in later)
    out["batch_size"], out["final_r2"] = tr.cfg.train.batch_size, tr.progress.history[-1]["r2"]
    if torch.cuda.is_available():
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    tr = None
    release()
    return out


class Recompiles(logging.Handler):
    """Dynamo's reason for each recompile (its `recompiles` log), kept for the results."""

    def __init__(self):
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record) -> None:
        text = record.getMessage()
        if "guard failure" in text:
            self.reasons.append(" ".join(line.strip() for line in text.splitlines()[2:]))


def item_compile(size: Size, put) -> None:
    import torch

    torch._logging.set_logs(recompiles=True, graph_breaks=True)  # each recompile's reason, in the log
    reasons = Recompiles()
    logging.getLogger("torch._dynamo").addHandler(reasons)
    epochs = ["train.epochs=3", "checkpoint.every_steps=1000"]
    compiled = trainer_run("A", size, "compile_on", [*epochs, "train.torch_compile=true"])
    compiled["recompile_reasons"] = reasons.reasons
    put("compiled", compiled)
    eager = trainer_run("A", size, "compile_off", [*epochs, "train.torch_compile=false"])
    put("eager", eager)
    put(
        "compiled_over_eager_steps_per_s",
        compiled["steps_per_s_after_epoch_1"] / eager["steps_per_s_after_epoch_1"],
    )
    end = compiled["compile_at_end"]
    put(
        "one_graph_no_recompile_no_fallback",
        end["graphs"] == 1 and end["recompiles"] == 0 and not end["fallback"],
    )


# ------------------------------------------------------------------------------ item: precision


def precision_run(amp: bool, size: Size, steps: int, deadline: float) -> dict:
    import torch

    import cloudml_lib.core.machine.device
    from cloudml_lib.core.machine.device import Precision

    cfg = config("C", size)
    device = torch.device(size.device)
    keep = cloudml_lib.core.machine.device.choose_precision
    if not amp:
        cloudml_lib.core.machine.device.choose_precision = lambda d: Precision(None, False)
    torch.manual_seed(0)
    model, opt, autocast, scaler, _ = build(cfg, device, compile_=False)
    cloudml_lib.core.machine.device.choose_precision = keep
    b, t = cfg.train.batch_size, cfg.data.temporal_frames
    batches = [synthetic_batch(b, t, size.frame, device, seed=s, scalars=n_scalars(model)) for s in range(4)]
    losses, skipped, t0 = [], 0, time.perf_counter()
    for i in range(steps):
        loss, applied = training_step(model, opt, autocast, scaler, batches[i % len(batches)], cfg.train)
        losses.append(float(loss))
        skipped += not applied
        if time.perf_counter() > deadline:
            break
    out = {"steps": len(losses), "steps_per_s": len(losses) / (time.perf_counter() - t0), "losses": losses}
    out["non_finite_losses"] = sum(not (x == x and abs(x) != float("inf")) for x in losses)
    out["skipped_by_scaler"], out["final_scale"] = (
        skipped,
        scaler.get_scale() if scaler.is_enabled() else None,
    )
    model = opt = batches = None
    release()
    return out


def item_precision(size: Size, put, box: float) -> None:
    start = time.perf_counter()
    fp16 = precision_run(True, size, size.precision_steps, start + box * 0.45)
    fp32 = precision_run(False, size, fp16["steps"], start + box * 0.9)
    n = min(fp16["steps"], fp32["steps"])
    tail = max(1, n // 10)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    put("fp16_grad_scaler", {k: v for k, v in fp16.items() if k != "losses"})
    put("fp32", {k: v for k, v in fp32.items() if k != "losses"})
    put("model", "preset C (32/64/128, checkpointing), its batch, the same seed and 4 batches in turn")
    put("losses_every_10th", {"fp16": fp16["losses"][:n:10], "fp32": fp32["losses"][:n:10]})
    put("first_loss", {"fp16": fp16["losses"][0], "fp32": fp32["losses"][0]})
    put(
        "mean_loss_last_tenth",
        {"fp16": mean(fp16["losses"][n - tail : n]), "fp32": mean(fp32["losses"][n - tail : n])},
    )
    put("fp16_over_fp32_steps_per_s", fp16["steps_per_s"] / fp32["steps_per_s"])


# ------------------------------------------------------------------------------ item: memory


def largest_fitting_batch(name: str, size: Size, start: int) -> dict:
    """Real steps of the eager model at growing, then bisected, batch sizes under the cap."""
    import torch

    cfg = config(name, size)
    device = torch.device(size.device)
    model, opt, autocast, scaler, _ = build(cfg, device, compile_=False)
    t = cfg.data.temporal_frames

    def fits(b: int) -> bool:
        try:
            batch = synthetic_batch(b, t, size.frame, device, scalars=n_scalars(model))
            training_step(model, opt, autocast, scaler, batch, cfg.train)
            sync()
            return True
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            return False
        finally:
            batch = None
            release()

    lo, hi, tried = 0, None, {}
    b = max(1, start)
    while hi is None and b <= 4096:
        tried[b] = fits(b)
        lo, hi, b = (b, None, int(b * 1.25) + 1) if tried[b] else (lo, b, b)
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        tried[mid] = fits(mid)
        lo, hi = (mid, hi) if tried[mid] else (lo, mid)
    model = opt = None
    release()
    return {"largest_fitting_batch": lo, "tried": {str(k): v for k, v in sorted(tried.items())}}


def probe_choice(name: str, size: Size) -> dict:
    """What the trainer's `train.batch_size: auto` chooses (memory.measure_batch_size on the eager model)."""
    import torch

    from cloudml_lib.core.machine.memory import probe_batch_size

    cfg = config(name, size)
    device = torch.device(size.device)
    model, opt, autocast, scaler, _ = build(cfg, device, compile_=False)
    t = cfg.data.temporal_frames

    def step(b):
        batch = synthetic_batch(b, t, size.frame, device, scalars=n_scalars(model))
        training_step(model, opt, autocast, scaler, batch, cfg.train)

    r = probe_batch_size(step, device, budget=int(T4_GIB * 2**30))
    model = opt = None
    release()
    return {
        "recommended_batch": r.recommended,
        "fixed_gib": r.fixed_bytes / 2**30,
        "per_sample_gib": r.per_sample_bytes / 2**30,
        "predicted_peak_at_recommended_gib": r.predicted_peak(r.recommended) / 2**30,
        "margin": 0.15,
    }


def forced_oom_run(size: Size) -> dict:
    """The real Trainer, preset B at batch 40 under a lower cap: training and evaluation run out of memory and
    recover. The effective batch and the optimizer steps must be those of a run that fits."""
    set_cap(OOM_CAP_GIB)
    cfg = config("B", size, ["train.epochs=1", "train.batch_size=40", "train.torch_compile=false"])
    tr = trainer(cfg, SCRATCH / "oom")
    steps_expected = tr.steps_per_epoch
    tr.fit()
    st = tr.progress
    out = {"memory_cap_gib": OOM_CAP_GIB, "batch_size": cfg.train.batch_size, "eval_batch_size_at_start": 80}
    out.update({k: getattr(st, k) for k in ("micro_batch_size", "eval_batch_size", "oom_recoveries", "step")})
    out["optimizer_steps_expected"], out["batch_size_after"] = steps_expected, tr.cfg.train.batch_size
    out["training_recovered"] = st.oom_recoveries > 0 and st.step == steps_expected
    out["evaluation_recovered"] = st.eval_batch_size < 80
    out["final_r2"] = tr.progress.history[-1]["r2"]
    set_cap(T4_GIB)
    return out


SMOKE_SKIPS = {"memory": "needs CUDA: out of memory and the probe are measured on a GPU only"}


def skipped_here(name: str, size: Size, cuda: bool) -> str | None:
    """Why item `name` does not run here (said in the results without starting its process), or None."""
    if size.smoke and name in SMOKE_SKIPS:
        return SMOKE_SKIPS[name]
    return None if cuda else NEEDS_CUDA.get(name)


def item_memory(size: Size, put) -> None:
    if size.smoke:
        put("skipped", SMOKE_SKIPS["memory"])
        return
    for name in ("A", "B"):
        probe = probe_choice(name, size)
        real = largest_fitting_batch(name, size, probe["recommended_batch"])
        real["probe"], real["probe_over_largest"] = (
            probe,
            probe["recommended_batch"] / max(1, real["largest_fitting_batch"]),
        )
        put(name, real)
    put("forced_oom", forced_oom_run(size))


# ------------------------------------------------------------------------------ item: predict


def item_predict(size: Size, put) -> None:
    from benchmarks.predict import FLIGHT_FRAMES, child

    for path in ("per_frame", "per_frame_cl"):
        out = SCRATCH / f"predict_{path}.json"
        child(
            "demo" if size.smoke else "full",
            path,
            size.flight_frames,
            size.device,
            out,
            folder=SCRATCH / "flights",
        )
        r = json.loads(out.read_text())
        r["frames_per_s"] = r["frames"] / r["predict_s"]
        r["flight_12000_min"] = (r["start_s"] + FLIGHT_FRAMES * r["predict_s"] / r["frames"]) / 60
        put(path, r)
    model = "the demo model" if size.smoke else "preset B (64/128/256)"
    put(
        "model",
        f"{model}, random weights, each frame encoded once; the flight read and preprocessed by workers",
    )


# ------------------------------------------------------------------------------ item: resume


def cli_run(size: Size, run: str, kill_at: str | None) -> subprocess.CompletedProcess:
    """`cloudml train` in a process of its own (this script's --cli: T4 standing, determinism)."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8", PYTHONUNBUFFERED="1")
    env.pop("CLOUDML_KILL_AT", None)
    if kill_at:
        env["CLOUDML_KILL_AT"] = kill_at
    sets = size.data_overrides(SCRATCH / "flights", SCRATCH / "cache")
    sets += ["train.epochs=2", "checkpoint.every_steps=3", "train.torch_compile=false"]
    cmd = [sys.executable, __file__, *(["--smoke"] if size.smoke else []), "--cli", "train", "--preset", "B"]
    cmd += ["--run-dir", str(SCRATCH / run)] + [a for s in sets for a in ("--set", s)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True)


def identical(diffs: dict) -> bool:
    """compare_states found every tensor equal bit for bit."""
    return all(d["equal_bits"] == d["tensors"] for d in diffs.values())


def final_state(run: str) -> dict:
    from cloudml_lib.core.run.checkpoint import find_checkpoints, load_checkpoint
    from cloudml_lib.core.run.folder import RunFolder

    return load_checkpoint(
        find_checkpoints(RunFolder(SCRATCH / run))[0] / "state.pt"
    )  # newest first: the final one


def compare_states(a: dict, b: dict) -> dict:
    import torch

    diffs = {}
    for piece in [k for k in ("model", "optimizer", "ema") if k in a]:  # ema: the weights' average, if kept
        flat_a, flat_b = flatten(a[piece]), flatten(b[piece])
        d = [
            (k, (flat_a[k].double() - flat_b[k].double()).abs().max().item())
            for k in flat_a
            if torch.is_tensor(flat_a[k])
        ]
        diffs[piece] = {"tensors": len(d), "equal_bits": sum(torch.equal(flat_a[k], flat_b[k]) for k, _ in d),
                        "max_abs_diff": max((x for _, x in d), default=0.0)}  # fmt: skip
    return diffs


def flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flatten(val, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flatten(val, f"{prefix}{i}.").items()}
    return {prefix: obj}


def item_resume(size: Size, put) -> None:
    """Killed by SIGKILL and resumed, against an uninterrupted run; and a second uninterrupted run, which says
    whether training on this machine repeats itself bit for bit at all (a difference between the two
    uninterrupted runs is the machine's, not the resume's: once in about ten smoke runs on a 2-core CPU). The
    CPU smoke trains that second run only where the resumed run differs from the first (its only use
    there); the GPU run always does (whether the GPU repeats itself is a result of its own)."""
    for run in ("resume_ref", "resume_again", "resume_killed"):
        shutil.rmtree(SCRATCH / run, ignore_errors=True)
    ref = cli_run(size, "resume_ref", None)
    put("uninterrupted_exit", ref.returncode)
    kill = 4 if size.smoke else 7
    killed = cli_run(size, "resume_killed", f"step:{kill}")
    put("killed_exit", killed.returncode)
    put("killed_by_sigkill", killed.returncode == -9)
    resumed = cli_run(size, "resume_killed", None)
    put("resumed_exit", resumed.returncode)
    for name, p in (("uninterrupted", ref), ("resumed", resumed)):
        if p.returncode:
            put(f"{name}_stderr", in_repo(p.stderr[-1500:]))
    resumed_from = [in_repo(line) for line in resumed.stdout.splitlines() if "esum" in line][:2]
    put("resumed_log", resumed_from)
    if ref.returncode or resumed.returncode:
        return
    diffs = compare_states(final_state("resume_ref"), final_state("resume_killed"))
    put("final_state", diffs)
    put("bit_identical", identical(diffs))
    same = identical(diffs)
    if not (size.smoke and same):
        again = cli_run(size, "resume_again", None)
        if again.returncode:
            put("again_stderr", in_repo(again.stderr[-1500:]))
            return
        put(
            "uninterrupted_runs_identical",
            identical(compare_states(*map(final_state, ("resume_ref", "resume_again")))),
        )
        same = same or identical(compare_states(final_state("resume_again"), final_state("resume_killed")))
    else:
        put("uninterrupted_runs_identical", "not run: the resumed run equals the first bit for bit")
    put("bit_identical_to_either", same)
    evals = [
        json.loads((SCRATCH / r / "evaluation.json").read_text())["overall"]
        for r in ("resume_ref", "resume_killed")
    ]
    put("evaluation_equal", evals[0] == evals[1])
    put("determinism", "torch.use_deterministic_algorithms(True, warn_only=True), cudnn.deterministic, "
        "cudnn.benchmark off, CUBLAS_WORKSPACE_CONFIG=:4096:8; killed by SIGKILL after optimizer step "
        f"{kill} (checkpoints every 3 steps)")  # fmt: skip


def cli(argv: list[str], smoke: bool) -> int:
    """`python -m cloudml_lib` standing for a T4, with deterministic algorithms (the resume item's runs)."""
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    stand_for_t4()
    from cloudml_lib.commands.cli import main as cloudml

    return cloudml(argv)


# ------------------------------------------------------------------------------ the run


def run_item(name: str, size: Size, out: Path, box: float) -> None:
    """One item in this process; what it measures is written to `out` as it goes."""
    import torch

    found: dict = {}

    def put(key, value):
        found[key] = value
        out.write_text(json.dumps(found, indent=1, default=str))

    put("started", time.strftime("%H:%M:%S"))
    put("t4", stand_for_t4())
    if name != "presets":
        make_flights(size)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    items = {"presets": item_presets, "compile": item_compile, "memory": item_memory, "predict": item_predict,
             "resume": item_resume, **ITEM_FUNCTIONS}  # fmt: skip
    items.get(name, lambda s, p: item_precision(s, p, box))(size, put)
    put("item_s", time.perf_counter() - t0)


def header(size: Size) -> dict:
    import torch

    from benchmarks import machine

    return {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (smoke)",
        "machine": machine(),
        "memory_cap_gib": None if size.smoke else T4_GIB,
        "standing_for_t4": "fp16 + GradScaler, forced as on a T4" if not size.smoke else "fp32 (CPU smoke)",
        "frame": list(size.frame),
        "temporal_frames": 5,
        "torch": torch.__version__,
        "time_boxes_s": TIME_BOX,
    }


def orchestrate(size: Size, items: list[str], results: Path, log) -> dict:
    """Each item in a child process with its time box; the results file rewritten after each."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    old = json.loads(results.read_text()) if results.exists() and set(items) != set(ITEMS) else {}
    doc = {**old, **header(size)}
    import torch

    cuda = torch.cuda.is_available()
    flights = subprocess.Popen(
        [sys.executable, __file__, "--make-flights", *(["--smoke"] if size.smoke else [])]
    )
    for name in items:
        box = TIME_BOX[name] * (4 if size.smoke else 1)
        if why := skipped_here(name, size, cuda):
            doc[name] = {"skipped": why}
            results.write_text(json.dumps(doc, indent=1, default=str))
            print(f"gpu.py: {name}: skipped, {why}", flush=True)
            continue
        if name != "presets" and flights.wait() != 0:
            doc[name] = {"failed": "the synthetic flights could not be written; see the log"}
            results.write_text(json.dumps(doc, indent=1, default=str))
            continue
        part = SCRATCH / f"{name}.json"
        part.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--item", name, "--part", str(part)] + (
            ["--smoke"] if size.smoke else []
        )
        t0 = time.perf_counter()
        try:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=box).returncode
        except subprocess.TimeoutExpired:
            code = "timed out"
        got = json.loads(part.read_text()) if part.exists() else {}
        if code != 0:
            got["failed"] = (
                f"exit {code} after {time.perf_counter() - t0:.0f} s (time box {box:.0f} s); see the log"
            )
        doc[name] = got
        results.write_text(json.dumps(doc, indent=1, default=str))
        print(
            f"gpu.py: {name}: {'ok' if code == 0 else got['failed']} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    flights.wait()
    return doc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="CPU, tiny frames: check the code paths")
    p.add_argument(
        "--only",
        default=",".join(ITEMS),
        help=f"comma-separated items of {', '.join(ITEMS)}; t4: {', '.join(T4_ITEMS)}",
    )
    p.add_argument("--results", type=Path, default=None, help="results file (default results/gpu.json)")
    p.add_argument("--log", type=Path, default=None, help="the items' output (default: the console)")
    (
        p.add_argument("--item"),
        p.add_argument("--part", type=Path),
        p.add_argument("--make-flights", action="store_true"),
    )
    p.add_argument("--cli", nargs=argparse.REMAINDER)
    args = p.parse_args()
    size = Size(args.smoke)
    if args.cli is not None:
        sys.exit(cli(args.cli, args.smoke))
    if args.make_flights:
        return make_flights(size)
    if args.item:
        return run_item(args.item, size, args.part, TIME_BOX[args.item] * (4 if size.smoke else 1))
    import torch

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (use --smoke to check the code on the CPU)")
    asked = {i for word in args.only.split(",") for i in GROUPS.get(word, (word,))}
    unknown = asked - set(ITEMS)
    if unknown:
        p.error(f"--only: unknown item(s) {', '.join(sorted(unknown))}; choose from {', '.join(ITEMS)} or t4")
    items = [i for i in ITEMS if i in asked]
    results = args.results or (SCRATCH / "smoke.json" if args.smoke else RESULTS)
    with open(args.log, "a") if args.log else open(os.devnull, "w") as log:
        orchestrate(size, items, results, log if args.log else None)
    print(f"wrote {results}")


if __name__ == "__main__":
    main()
