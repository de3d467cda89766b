"""GPU memory of a training step: `train.batch_size: auto` measures two real steps at small batch sizes on a
copy of the model and fits fixed + per-sample bytes, then takes the largest batch that fits with a margin."""

from __future__ import annotations

import copy
import gc
import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

GIB = 2**30
MARGIN = 0.15  # memory head-room kept free by the probe and the preset choice
CPU_AUTO_BATCH = 16  # train.batch_size: auto on a CPU, where nothing can be measured


@dataclass
class ProbeResult:
    batch_sizes: tuple[int, int]
    peaks_bytes: tuple[int, int]
    fixed_bytes: float
    per_sample_bytes: float
    budget_bytes: int
    recommended: int

    def predicted_peak(self, batch: int) -> float:
        return self.fixed_bytes + self.per_sample_bytes * batch

    def describe(self) -> str:
        return (
            f"memory probe: one step takes {self.fixed_bytes / GIB:.2f} GiB + "
            f"{self.per_sample_bytes / GIB:.3f} "
            f"GiB per sample (measured at batch {self.batch_sizes[0]} and {self.batch_sizes[1]}); with a 15% "
            f"margin on {self.budget_bytes / GIB:.1f} GiB the largest batch that fits is {self.recommended} "
            f"(predicted peak {self.predicted_peak(self.recommended) / GIB:.2f} GiB)"
        )


def fit_batch_size(
    sizes: tuple[int, int], peaks: tuple[int, int], budget: int, cap: int = 256
) -> ProbeResult:
    """Line through two (batch, peak) points; the largest batch whose peak x 1.15 fits the budget."""
    (b1, b2), (p1, p2) = sizes, peaks
    per_sample = max((p2 - p1) / (b2 - b1), 1.0)
    fixed = max(p1 - per_sample * b1, 0.0)
    best = int((budget / (1 + MARGIN) - fixed) // per_sample)
    return ProbeResult(sizes, peaks, fixed, per_sample, budget, max(1, min(cap, best)))


def measure_step_peak(step, batch_size: int, device: torch.device) -> int:
    """Peak GPU memory of `step(batch_size)` (a full training step), in bytes."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step(batch_size)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def probe_batch_size(
    step,
    device: torch.device,
    sizes: tuple[int, int] = (2, 4),
    measure=measure_step_peak,
    budget: int | None = None,
) -> ProbeResult:
    """Measure one training step at two small batch sizes and fit the per-sample cost."""
    if budget is None:
        free, _ = torch.cuda.mem_get_info(device)
        budget = free + torch.cuda.memory_allocated(device)
    peaks = tuple(measure(step, b, device) for b in sizes)
    return fit_batch_size(sizes, peaks, budget)


def measure_batch_size(
    model: torch.nn.Module,
    autocast,
    device: torch.device,
    frames: int,
    frame_shape: tuple[int, int],
    guess=None,
) -> int:
    """train.batch_size: auto. Two measured steps on a copy of the model, on synthetic data. `guess`: the
    estimate's (estimate.Estimate, or None), whose largest batch for the free memory is logged beside the
    measurement; the measurement decides."""
    if device.type != "cuda":
        log.info("train.batch_size is 'auto', but measuring needs a GPU; using %d on the CPU", CPU_AUTO_BATCH)
        return CPU_AUTO_BATCH
    h, w = frame_shape
    probe_model = copy.deepcopy(model).train()
    probe_opt = torch.optim.AdamW(probe_model.parameters(), lr=1e-6)

    def step(b: int) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(b, frames, h, w, device=device, generator=gen)  # (b, T, H, W)
        scalars = torch.randn(b, probe_model.film[0].in_features, device=device, generator=gen)  # (b, 3)
        with autocast():
            loss = probe_model(x, scalars).height.float().pow(2).mean()
        loss.backward()
        probe_opt.step()
        probe_opt.zero_grad(set_to_none=True)

    with torch.random.fork_rng(devices=[device]):  # the run's RNG stream is untouched
        try:
            result = probe_batch_size(step, device)
        except torch.cuda.OutOfMemoryError:
            result = None
    probe_model = probe_opt = None  # release the copy before training allocates
    torch.cuda.empty_cache()
    if result is None:
        log.warning(
            "train.batch_size auto: even batch 2 does not fit on this GPU; using 1. Choose preset C "
            "(model.memory_optimized: true) or turn on model.gradient_checkpointing."
        )
        return 1
    first = (
        "" if guess is None else f"; the estimate's first guess: {guess.largest_batch(result.budget_bytes)}"
    )
    log.info("train.batch_size auto: %s%s", result.describe(), first)
    return result.recommended
