"""GPU memory of a training step: the one memory model (PeakLine: fixed + per-sample bytes, the largest batch
that fits a budget with a margin), which estimate.py computes from the model on fake tensors and the probe of
`train.batch_size: auto` measures (two real steps at small batch sizes on a copy of the model)."""

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


@dataclass(frozen=True)
class PeakLine:
    """The one memory model of a step, measured (the probe) or computed (estimate.py): its peak bytes as fixed
    + per sample x batch, drawn through two (batch, peak) points, and the largest batch whose peak fits a
    budget with a margin (and, for an estimate, a stated overhead and slack)."""

    fixed: float
    per_sample: float

    @classmethod
    def through(cls, sizes: tuple[int, int], peaks: tuple[float, float]) -> PeakLine:
        (b1, b2), (p1, p2) = sizes, peaks
        per_sample = max((p2 - p1) / (b2 - b1), 1.0)
        return cls(max(p1 - per_sample * b1, 0.0), per_sample)

    def peak(self, batch: int) -> float:
        return self.fixed + self.per_sample * batch

    def largest_batch(
        self, budget: float, margin: float = MARGIN, overhead: float = 0.0, slack: float = 0.0
    ) -> int:
        """The largest batch whose peak x (1 + slack) + overhead fits `budget` with the margin; 0 if none."""
        room = budget / (1 + margin) - overhead
        return max(0, int((room / (1 + slack) - self.fixed) // self.per_sample))


@dataclass
class ProbeResult:
    batch_sizes: tuple[int, int]
    peaks_bytes: tuple[int, int]
    line: PeakLine
    budget_bytes: int
    recommended: int

    @property
    def fixed_bytes(self) -> float:
        return self.line.fixed

    @property
    def per_sample_bytes(self) -> float:
        return self.line.per_sample

    def predicted_peak(self, batch: int) -> float:
        return self.line.peak(batch)

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
    line = PeakLine.through(sizes, peaks)
    return ProbeResult(sizes, peaks, line, budget, max(1, min(cap, line.largest_batch(budget))))


def first_guess(guess, budget: float, calibrated=None) -> str:
    """The estimate's largest batch for `budget` bytes, in words for the probe's line; with `calibrated`
    (timing.Calibration), also the batch once the estimate is scaled by what an earlier run held."""
    if guess is None:
        return ""
    words = f"; the estimate's first guess: {guess.largest_batch(budget)}"
    if calibrated is not None and calibrated.factor > 0:
        words += f", {guess.largest_batch(budget / calibrated.factor)} as {calibrated.words()}"
    return words


def synthetic_inputs(model, batch: int, frames: int, rows: int, cols: int, device=None, generator=None):
    """A batch of random inputs of the network's shapes: frames (B, T, H, W), the scalars it takes (B, S) and
    a height target (B,)."""
    kw = {"device": device, "generator": generator}
    scalars = model.film[0].in_features
    return (
        torch.randn(batch, frames, rows, cols, **kw),
        torch.randn(batch, scalars, **kw),
        torch.randn(batch, **kw),
    )


def synthetic_step(model, optimizer, autocast, scaler=None):
    """The one synthetic training step, as the trainer takes one: the forward under the run's own precision
    (`autocast`: a factory of its context, device.Precision.autocast), a loss on the height, the backward
    (through `scaler` where the run scales fp16 losses) and the optimizer's step. What the estimate counts
    (estimate.py, on fake tensors), the batch probe measures (measure_batch_size) and the timing times
    (timing.py). Returns step(inputs), `inputs` from synthetic_inputs."""

    def step(inputs) -> None:
        x, scalars, target = inputs
        with autocast():
            out = model(x, scalars)
        loss = (out.height.float() - target).pow(2).mean()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


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
    calibrated=None,
) -> int:
    """train.batch_size: auto. Two measured steps on a copy of the model, on synthetic data. `guess`: the
    estimate's (estimate.Estimate, or None), whose largest batch for the free memory is logged beside the
    measurement, and with `calibrated` (timing.Calibration: an earlier run on this kind of GPU) that guess
    corrected by what that run held; the measurement decides."""
    if device.type != "cuda":
        log.info("train.batch_size is 'auto', but measuring needs a GPU; using %d on the CPU", CPU_AUTO_BATCH)
        return CPU_AUTO_BATCH
    h, w = frame_shape
    probe_model = copy.deepcopy(model).train()
    probe_opt = torch.optim.AdamW(probe_model.parameters(), lr=1e-6)

    train_step = synthetic_step(probe_model, probe_opt, autocast)

    def step(b: int) -> None:
        gen = torch.Generator(device=device).manual_seed(0)
        train_step(synthetic_inputs(probe_model, b, frames, h, w, device, gen))

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
    log.info(
        "train.batch_size auto: %s%s", result.describe(), first_guess(guess, result.budget_bytes, calibrated)
    )
    return result.recommended
