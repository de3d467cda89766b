"""How long a run will take, before it starts, and how long it took: seconds per training step from the best
source there is, in this order:

1. an earlier run on the same kind of device with the same step (widths, checkpointing, window, frame, batch):
   what its epochs took (run.json's "measured", written by the trainer), said as "measured in your run X";
2. a few timed steps here (the real model and AdamW on random inputs of the run's shape, at the run's own
   batch, after warm-up steps that are left out: first calls allocate and choose kernels), said as measured;
3. the step's FLOPs (machine/estimate.py counts them) at the share of the device's peak rate the same step
   reached on the GPU lent to the benchmarks (benchmarks/results/gpu.json), labelled as an estimate.

An epoch is its training steps plus its validation forwards (about a third of a training step each, the
validation batch being twice the training batch); torch.compile is not timed (compiled steps are usually
faster: the estimate errs long). The trainer writes what its epochs took into run.json beside the estimate the
notebook started it from (CLOUDML_EXPECTED), so every estimate can be checked against what happened.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.resources import measured as benchmark_results
from cloudml_lib.base.shapes import NUM, OPT_NUM, OPT_TEXT, TEXT, Damaged, Obj, parse_json
from cloudml_lib.core.machine import estimate
from cloudml_lib.core.machine.device import choose_precision
from cloudml_lib.core.machine.memory import synthetic_inputs, synthetic_step
from cloudml_lib.core.network.model import training_memory_format

log = logging.getLogger(__name__)

WARMUP_STEPS = 2  # left out of the timing: first-call allocations and kernel choices
# timed after them, at the run's own batch: at least TIMED_STEPS, and more until TIMED_S have passed (up to
# MAX_TIMED_STEPS), the median kept. Three steps alone read 0.059-0.144 s for the demo's 0.05 s step on a
# quiet 2-core CPU (a burst of another process's work lands on one of three); a second's median is steady
TIMED_STEPS = 3
TIMED_S = 1.0
MAX_TIMED_STEPS = 20
STEP_BUDGET_S = 20.0  # a warm-up step slower than this: one step is timed (a large step on a CPU)
FORWARD_SHARE = 1 / 3  # an inference forward against a training step (forward + backward + update)
# the share of a GPU's peak rate where no measurement says (flops_efficiency reads the lent GPU's): an
# H200 measured 1.3-9.5 % (benchmarks/results/gpu.json), so a stated 25 % was 2.4-9x optimistic
FLOPS_EFFICIENCY = 0.04
# The end of a run (science/finish.py: the cloud probe over the training flights' frames, the validation and
# test samples scored, the intervals, the report) reads every sample once, forward only: its seconds per
# sample against a training epoch's per sample (optimizer steps and the epoch's validation). Measured for the
# demo on a 2-core CPU: 0.78 (7 s for 1332 samples, loading the data and the weights included). A run records
# its own (run.json "end"); later expected times on that kind of device use it (end_share).
END_SHARE = 0.75
END_SHARE_RANGE = (0.01, 100.0)
# A scalars-only run's end against its training epoch's time per sample (no frame is encoded in either, so
# reading the samples weighs more): 0.8-1.0 s for 1332 samples, about 1.5, in the demo's cross-validation
END_SHARE_SCALARS = 1.5
# A cross-validation's scalars-only control against its fold's model run (the same samples, no frames
# encoded): its epochs and end took 3.2-4.4 s against 38-50 s in the demo's cross-validation on a 2-core CPU
CONTROL_SHARE = 0.08
EXPECTED_ENV = "CLOUDML_EXPECTED"  # the estimate a run was started from (the notebook sets it), as JSON
EXPECTED_SHAPE = Obj(
    {"step_s": NUM, "epoch_s": NUM, "total_s": NUM, "end_s": OPT_NUM, "source": TEXT, "device": OPT_TEXT},
    required=("step_s", "source"),
)


@dataclass(frozen=True)
class StepTime:
    """Seconds per training step (one batch, optimizer included), and where the figure comes from."""

    seconds: float
    source: str  # in words: "measured here by 2 timed steps", "measured in your run X", "estimated ..."
    measured: bool  # False: an estimate from FLOPs
    with_validation: bool = False  # an earlier run's: its epochs' time per step, validation included


def signature(shape: estimate.StepShape, batch: int) -> dict:
    """What a step's time depends on (as run.json and the picker compare it)."""
    return {
        "channels": list(shape.channels),
        "checkpointing": shape.checkpointing,
        "frames": shape.frames,
        "rows": shape.rows,
        "cols": shape.cols,
        "batch": int(batch),
    }


def device_name(device: torch.device) -> str:
    """The kind of device, as runs are matched by it ("Tesla T4", "CPU (2 threads)")."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).name
    return f"CPU ({torch.get_num_threads()} threads)"


def timed(shape: estimate.StepShape, batch: int, device: torch.device) -> StepTime:
    """Seconds per training step at the run's own `batch`: WARMUP_STEPS left out (first-call allocations,
    kernel choices), then TIMED_STEPS timed and more until TIMED_S have passed (MAX_TIMED_STEPS at most), one
    only where a warm-up step took longer than STEP_BUDGET_S; their median."""
    seconds, n = _step_seconds(shape, batch, device)
    if device.type == "cuda":  # the kernel keeps no GPU memory that a training subprocess could use
        torch.cuda.empty_cache()
    return StepTime(seconds, f"measured here by {n} timed step{'s' * (n > 1)} at batch {batch}", True)


def _step_seconds(shape: estimate.StepShape, b: int, device: torch.device) -> tuple[float, int]:
    """(the median time of one step at batch `b`, the steps timed); the model and its tensors are freed on
    return: the one synthetic step (memory.synthetic_step) in the memory format and under the precision a run
    on `device` takes (model.training_memory_format; device.choose_precision: fp16 with loss scaling on a
    T4, bf16 from capability 8, fp32 on a CPU)."""
    precision = choose_precision(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = estimate.model_of(shape).to(device).train()
        if training_memory_format(device)[0]:  # the format a new run trains in here
            model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler(device.type) if precision.use_grad_scaler else None
        step = synthetic_step(model, optimizer, precision.autocast(device), scaler)
        inputs = synthetic_inputs(model, b, shape.frames, shape.rows, shape.cols, device)
        times = [_one(step, inputs, device) for _ in range(WARMUP_STEPS)]
        if max(times) >= STEP_BUDGET_S:
            return _one(step, inputs, device), 1
        times = [_one(step, inputs, device) for _ in range(TIMED_STEPS)]
        while sum(times) < TIMED_S and len(times) < MAX_TIMED_STEPS:
            times.append(_one(step, inputs, device))
        return statistics.median(times), len(times)


def _one(step, inputs, device: torch.device) -> float:
    t0 = time.perf_counter()
    step(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def flops_efficiency(shape: estimate.StepShape) -> tuple[float, str]:
    """The share of a GPU's peak rate a step of `shape` reaches, and where the figure comes from: the share
    the same step (channels, checkpointing) reached on the GPU lent to the benchmarks (benchmarks/gpu.py,
    its eager presets: a compiled step does better), else the lowest share measured there."""
    got = benchmark_results("gpu") or {}
    presets, shares = got.get("presets"), {}
    for name, p in (presets or {}).items() if isinstance(presets, dict) else ():
        share = p.get("fraction_of_peak_flops") if isinstance(p, dict) else None
        if isinstance(share, float) and 0.001 <= share <= 1.0 and p.get("torch_compile") is False:
            shares[(tuple(p.get("channels") or ()), bool(p.get("gradient_checkpointing")))] = (name, share)
    if not shares:
        return FLOPS_EFFICIENCY, "a stated share (nothing measured)"
    device = got.get("device") if isinstance(got.get("device"), str) else "a lent GPU"
    same = shares.get((tuple(shape.channels), bool(shape.checkpointing)))
    if same:
        return same[1], f"the share preset {same[0]}'s eager step reached on {device[:40]}"
    name, share = min(shares.values(), key=lambda v: v[1])
    return share, f"the lowest share an eager preset's step reached on {device[:40]} (preset {name})"


def from_flops(shape: estimate.StepShape, batch: int, peak_flops: float) -> StepTime | None:
    """The step's FLOPs at the share of `peak_flops` measured for it (flops_efficiency); None where they
    cannot be counted."""
    found = estimate.estimate(shape)
    if found is None or peak_flops <= 0:
        return None
    share, why = flops_efficiency(shape)
    seconds = found.flops_per_sample * batch / (peak_flops * share)
    return StepTime(
        seconds,
        f"estimated from the step's {found.flops_per_sample * batch / 1e12:.2f} TFLOP at "
        f"{share:.1%} of {peak_flops / 1e12:.0f} TFLOP/s, {why}",
        False,
    )


def newest_run(runs: Path, device: str, sig: dict) -> tuple[str, dict] | None:
    """The newest earlier run in `runs` on this kind of device with this step: (its name, its run.json's
    "measured")."""
    best = None
    for run in sorted(p for p in Path(runs).glob("*") if p.is_dir()) if Path(runs).is_dir() else []:
        measured = read_measured(RunLayout(run))
        if not measured or measured.get("device") != device or measured.get("signature") != sig:
            continue
        when = measured.get("at", 0.0)
        if best is None or when > best[0]:
            best = (when, run.name, measured)
    return None if best is None else (best[1], best[2])


def from_runs(runs: Path, device: str, sig: dict) -> StepTime | None:
    """The step time an earlier run on this kind of device with this step measured (newest_run)."""
    found = newest_run(runs, device, sig)
    if found is None:
        return None
    return StepTime(found[1]["step_s"], f"measured in your run {found[0]}", True, with_validation=True)


def peak_words(runs: Path, device: str, sig: dict) -> str | None:
    """What an earlier run with this step on this kind of device held at its peak, in words ("9.1 GiB
    reserved on the GPU, measured in your run X"); None without one."""
    found = newest_run(runs, device, sig)
    peak = (found[1].get("peak_memory") or {}) if found else {}
    if isinstance(peak.get("peak_reserved_gib"), (int, float)):
        return f"{peak['peak_reserved_gib']:.1f} GiB reserved on the GPU, measured in your run {found[0]}"
    if isinstance(peak.get("peak_rss_gib"), (int, float)):
        return f"{peak['peak_rss_gib']:.1f} GiB of host memory, measured in your run {found[0]}"
    return None


def measured_words(runs: Path, device: str, sig: dict) -> str:
    """What the newest earlier run with this step on this kind of device measured: its peak memory and its
    steps/s ("4.96 GiB reserved on the GPU, 5.8 steps/s, measured in your run X"); "-" without one."""
    found = newest_run(runs, device, sig)
    if found is None:
        return "-"
    name, got = found
    peak = got.get("peak_memory") or {}
    parts = [
        f"{peak[k]:.2f} GiB {what}"
        for k, what in (("peak_reserved_gib", "reserved on the GPU"), ("peak_rss_gib", "of host memory"))
        if isinstance(peak.get(k), (int, float))
    ]
    return ", ".join(parts[:1] + [f"{1 / got['step_s']:.1f} steps/s"]) + f", measured in your run {name}"


@dataclass(frozen=True)
class Calibration:
    """An earlier run's GPU memory against the estimate's need for its own batch (the same step but the
    batch, on this kind of device): the factor that turns the estimate into what this GPU held."""

    run: str
    batch: int
    reserved_gib: float
    need_gib: float

    @property
    def factor(self) -> float:
        return self.reserved_gib / self.need_gib

    def words(self) -> str:
        return (
            f"measured in your run {self.run}: {self.reserved_gib:.2f} GiB reserved at batch {self.batch}, "
            f"{self.factor:.2f}x the estimate's {self.need_gib:.2f} GiB"
        )


def calibration(runs: Path, device: str, sig: dict, need_gib) -> Calibration | None:
    """The newest earlier run in `runs` on this kind of CUDA device whose step is `sig` at any batch and
    that measured its peak reserved memory; `need_gib(batch)`: the estimate's need at a batch (GiB)."""
    best = None
    same = {k: v for k, v in sig.items() if k != "batch"}
    for run in sorted(p for p in Path(runs).glob("*") if p.is_dir()) if Path(runs).is_dir() else []:
        got = read_measured(RunLayout(run))
        if not got or got.get("device") != device:
            continue
        their = got["signature"]
        reserved = (got.get("peak_memory") or {}).get("peak_reserved_gib")
        batch = their.get("batch")
        if (
            {k: v for k, v in their.items() if k != "batch"} != same
            or not isinstance(batch, int)
            or batch < 1
        ):
            continue
        if (
            isinstance(reserved, (int, float))
            and reserved > 0
            and (best is None or got.get("at", 0) > best[0])
        ):
            best = (got.get("at", 0), Calibration(run.name, batch, float(reserved), float(need_gib(batch))))
    return None if best is None else best[1]


# what a run's "measured" block may hold: (low, high) for each number (a number outside is no measurement)
MEASURED_RANGES = {
    "step_s": (1e-5, 3600.0),  # seconds per optimizer step
    "epoch_s": (1e-3, 30 * 86400.0),
    "estimated_need_gib": (0.0, 4096.0),
}
PEAK_GIB = (0.0, 4096.0)
MAX_EPOCHS_KEPT = 100_000  # per-epoch figures a "measured" block may list
MAX_SEGMENTS = 1000  # starts of one run that run.json keeps
_told: set[str] = set()


def measured_problem(got) -> str | None:
    """What is wrong with a "measured" block (a hand edit, another tool's file), in words; None when every
    field is of the type and in the range the trainer writes."""
    if not isinstance(got, dict):
        return f"'measured' is {type(got).__name__}, not an object"
    if not isinstance(got.get("device"), str) or not isinstance(got.get("signature"), dict):
        return "'measured' lacks its device (text) or its step's signature (an object)"

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for key, (low, high) in MEASURED_RANGES.items():
        v = got.get(key)
        if (v is not None or key == "step_s") and not (number(v) and low <= v <= high):
            return f"'measured.{key}' is {str(v)[:40]!r}, expected a number from {low:g} to {high:g}"
    for key, bounds in (
        ("each_step_s", MEASURED_RANGES["step_s"]),
        ("each_epoch_s", MEASURED_RANGES["epoch_s"]),
    ):
        each = got.get(key)
        if each is not None and not (
            isinstance(each, list) and len(each) <= MAX_EPOCHS_KEPT and all(number(v) for v in each)
            and all(bounds[0] <= v <= bounds[1] for v in each)
        ):  # fmt: skip
            return (
                f"'measured.{key}' is {str(each)[:40]!r}, expected a list of numbers from {bounds[0]:g} to "
                f"{bounds[1]:g}"
            )
    timed = got.get("epochs_timed")
    if timed is not None and not (isinstance(timed, int) and not isinstance(timed, bool) and timed >= 1):
        return f"'measured.epochs_timed' is {str(timed)[:40]!r}, expected a whole number of 1 or more"
    at = got.get("at")
    if at is not None and not (number(at) and 0 < at < time.time() + 86400):
        return f"'measured.at' is {str(at)[:40]!r}, expected a time (seconds since 1970) not in the future"
    peak = got.get("peak_memory")
    if peak is not None and not isinstance(peak, dict):
        return f"'measured.peak_memory' is {type(peak).__name__}, expected an object of GiB figures"
    for k, v in (peak or {}).items():
        if not (number(v) and PEAK_GIB[0] <= v <= PEAK_GIB[1]):
            return f"'measured.peak_memory.{k}' is {str(v)[:40]!r}, expected GiB from 0 to {PEAK_GIB[1]:g}"
    return None


def read_measured(run: RunLayout) -> dict | None:
    """run.json's "measured" of a run folder: None where absent, or where any field is not of the type and in
    the range the trainer writes (said once per folder: nothing from it is shown or used)."""
    from cloudml_lib.base.runfiles import RunFiles

    got = RunFiles(run.path).run_info().get("measured")
    if got is None:
        return None
    problem = measured_problem(got)
    if problem:
        if str(run) not in _told:
            _told.add(str(run))
            log.warning("%s: %s; its measurements are left out (the run itself is unchanged)",
                        run.run_info, problem)  # fmt: skip
        return None
    return got


@dataclass(frozen=True)
class Expected:
    """A run's expected time: per step, per epoch (training steps + validation forwards) and in all."""

    step: StepTime
    steps_per_epoch: int | None  # None: the epoch's length is not known yet (no cache)
    val_batches: int
    epochs: int
    step_samples: int = 0  # samples per optimizer step (the batch times the accumulation); 0: not known
    end_samples: int = 0  # the samples the run's end reads (end_seconds); 0: its end not counted
    share: tuple[float, str] = (END_SHARE, "as measured for the demo on a CPU")  # end_share's

    @property
    def end_s(self) -> float | None:
        """The end of the run after its last epoch (end_seconds), at this run's epoch time per sample."""
        if self.epoch_s is None or not (self.step_samples and self.end_samples and self.steps_per_epoch):
            return None
        per = self.epoch_s / (self.steps_per_epoch * self.step_samples)
        return end_seconds(per, self.end_samples, self.share[0])

    @property
    def epoch_s(self) -> float | None:
        if self.steps_per_epoch is None:
            return None
        if self.step.with_validation:
            return self.step.seconds * self.steps_per_epoch
        # a validation forward at twice the batch: twice FORWARD_SHARE of a training step
        return self.step.seconds * (self.steps_per_epoch + 2 * FORWARD_SHARE * self.val_batches)

    @property
    def total_s(self) -> float | None:
        return None if self.epoch_s is None else self.epoch_s * self.epochs

    def words(self, what: str = "the run") -> str:
        label = "" if self.step.measured else " (an estimate)"
        if self.epoch_s is None:
            return (
                f"Expected time: about {duration(self.step.seconds)} per training step{label} "
                f"({self.step.source}); the epoch's length is known once the setup notebook has built "
                "the cache."
            )
        end = (
            ""
            if self.end_s is None
            else f"; then about {duration(self.end_s)} for its end (the cloud probe, scoring, report: "
            f"{self.end_samples} samples read, {self.share[1]})"
        )
        return (
            f"Expected time{label}: about {duration(self.epoch_s)} per epoch ({self.steps_per_epoch} steps "
            f"of {duration(self.step.seconds)}), {duration(self.total_s)} for {what} ({self.step.source})"
            f"{end}."
        )

    def record(self, device: str) -> dict:
        """What run.json keeps of it (the run's "expected")."""
        return {
            "step_s": self.step.seconds,
            "epoch_s": self.epoch_s,
            "total_s": self.total_s,
            "end_s": self.end_s,
            "source": self.step.source,
            "device": device,
        }


def end_share(runs: Path, device: str, scalars_only: bool = False) -> tuple[float, str]:
    """The end's seconds per sample against a training epoch's (END_SHARE), and where it comes from: the
    newest earlier run in `runs` on this kind of device, with frames or scalars only as asked, that recorded
    its end (run.json "end"), else the figure measured for the demo."""
    best = None
    for run in sorted(p for p in Path(runs).glob("*") if p.is_dir()) if Path(runs).is_dir() else []:
        got = read_end(RunLayout(run))
        if got is None or got["device"] != device or got.get("scalars_only", False) != scalars_only:
            continue
        if best is None or got["at"] > best[0]:
            best = (got["at"], run.name, got["share"])
    if best is None:
        return (END_SHARE_SCALARS if scalars_only else END_SHARE), "as measured for the demo on a CPU"
    return best[2], f"as measured in your run {best[1]}"


def end_seconds(per_sample_s: float, samples: int, share: float) -> float:
    """The expected time of a run's end: every sample it reads (`samples`: the probe's frames, the validation
    and test samples), forward only, at `share` of a training epoch's `per_sample_s`."""
    return per_sample_s * share * samples


def end_record(expected_s: float | None, took_s: float, samples: int, per_sample_s: float | None,
               device: str, scalars_only: bool) -> dict:  # fmt: skip
    """What run.json keeps of a run's end ("end"): its expected time (None where the run measured no epoch
    on this kind of device), what it took, the samples it read, and its share of a training epoch's time
    per sample."""
    share = took_s / (per_sample_s * samples) if per_sample_s and samples else None
    return {
        "expected_s": expected_s,
        "took_s": took_s,
        "samples": samples,
        "share": share,
        "device": device,
        "scalars_only": scalars_only,
        "at": time.time(),
    }


def read_end(run: RunLayout) -> dict | None:
    """run.json's "end" of a run folder where every field is of its type and range; else None."""
    from cloudml_lib.base.runfiles import RunFiles

    got = RunFiles(run.path).run_info().get("end")
    if not isinstance(got, dict):
        return None
    share, took, at = got.get("share"), got.get("took_s"), got.get("at")
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    if not (number(share) and END_SHARE_RANGE[0] <= share <= END_SHARE_RANGE[1]):
        return None
    if not (number(took) and 0 <= took <= 30 * 86400 and _is_time(at) and isinstance(got.get("device"), str)):
        return None
    return got


def per_sample(measured: dict | None, accumulation: int = 1) -> float | None:
    """A training epoch's seconds per sample from a run's "measured" (its optimizer step's time, the epoch's
    validation included, over the samples of one step: the batch times train.grad_accum_steps); None
    without one."""
    if not measured:
        return None
    batch = (measured.get("signature") or {}).get("batch")
    if not isinstance(batch, int) or batch < 1:
        return None
    return measured["step_s"] / (batch * max(1, int(accumulation)))


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def expected_from_env(environ) -> dict | None:
    """The estimate the notebook started this run from (CLOUDML_EXPECTED), checked; None without one."""
    text = environ.get(EXPECTED_ENV)
    if not text:
        return None
    try:
        return checked_expected(parse_json(text[:4096], EXPECTED_SHAPE))
    except Damaged:
        return None


def checked_expected(got) -> dict | None:
    """An "expected" block as run.json keeps it, or None where a field is not of its type or range."""
    if not isinstance(got, dict) or EXPECTED_SHAPE.problem(got, "expected"):
        return None
    for key in ("step_s", "epoch_s", "total_s", "end_s"):
        v = got.get(key)
        if v is not None and not 1e-5 <= v <= 1e9:
            return None
    return got


def _is_time(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < time.time() + 86400


def segments_of(info: dict) -> list[dict]:
    """The segments (one per start) of a run's run.json, each with its "expected" and "measured" checked
    (a field out of type or range reads as absent); a run written before segments were kept: one segment
    from its own figures."""
    found = info.get("segments")
    if not isinstance(found, list):
        found = [info] if info.get("expected") or info.get("measured") else []
    segments = []
    for seg in found[-MAX_SEGMENTS:]:
        if not isinstance(seg, dict):
            continue
        measured = seg.get("measured")
        segments.append(
            {
                "start_step": seg.get("start_step") if isinstance(seg.get("start_step"), int) else None,
                "started_at": seg.get("started_at") if _is_time(seg.get("started_at")) else None,
                "expected": checked_expected(seg.get("expected")),
                "measured": measured if measured_problem(measured) is None else None,
            }
        )
    return segments


class Measured:
    """What a run's epochs took on this start (its segment of the run): per step, per full epoch, the peak
    memory. `combined` puts the segments of one run together, so that a resumed run's figures span all its
    starts on this kind of device, not only the last one."""

    def __init__(self, device: str, sig: dict):
        self.device, self.sig, self.step_s, self.epoch_s, self.peak = device, sig, [], [], {}
        self.estimated_need_gib: float | None = None  # on CUDA: the estimate's need at the run's batch

    def epoch(self, seconds: float, steps: int, full: bool, memory: dict) -> None:
        if steps > 0:
            self.step_s.append(seconds / steps)
        if full:
            self.epoch_s.append(seconds)
        for k, v in memory.items():
            if isinstance(v, (int, float)):
                self.peak[k] = max(v, self.peak.get(k, v))

    def record(self) -> dict | None:
        """This start's figures (a segment's "measured"); None before its first epoch."""
        if not self.step_s:
            return None
        return summary(self.device, self.sig, self.step_s, self.epoch_s, self.peak, self.estimated_need_gib)


def summary(device: str, sig: dict, step_s: list, epoch_s: list, peak: dict, need_gib) -> dict:
    """A "measured" block: medians of the epochs' figures, the figures themselves, the peak memory."""
    return {
        "device": device,
        "signature": sig,
        "step_s": statistics.median(step_s),
        "epoch_s": statistics.median(epoch_s) if epoch_s else None,
        "epochs_timed": len(step_s),
        "each_step_s": list(step_s)[-MAX_EPOCHS_KEPT:],
        "each_epoch_s": list(epoch_s)[-MAX_EPOCHS_KEPT:],
        "peak_memory": dict(peak),
        "estimated_need_gib": need_gib,
        "at": time.time(),
    }


def combined(blocks: list[dict]) -> dict | None:
    """One "measured" block for the run from its segments' blocks (oldest first): the epochs of every segment
    on the newest one's device with its step (an earlier segment without per-epoch figures counts by its
    medians); None without any."""
    blocks = [b for b in blocks if isinstance(b, dict) and measured_problem(b) is None]
    if not blocks:
        return None
    newest = blocks[-1]
    same = [b for b in blocks if b["device"] == newest["device"] and b["signature"] == newest["signature"]]
    step_s, epoch_s, peak = [], [], {}
    for b in same:
        step_s += b.get("each_step_s") or [b["step_s"]] * min(b.get("epochs_timed", 1), MAX_EPOCHS_KEPT)
        epoch_s += b.get("each_epoch_s") or ([b["epoch_s"]] if b.get("epoch_s") is not None else [])
        for k, v in (b.get("peak_memory") or {}).items():
            peak[k] = max(v, peak.get(k, v))
    return summary(
        newest["device"], newest["signature"], step_s, epoch_s, peak, newest.get("estimated_need_gib")
    )
