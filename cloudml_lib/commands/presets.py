"""Which preset and batch to use on the machine at hand: the presets' memory (estimated from the model
on fake tensors, measured by benchmarks/gpu.py where a GPU ran it), the choice of `--preset auto`, the
memory table, the `diagnose` report and its plain-words recommendations. The machine's facts are
core/machine/device.py's; this is the policy the commands and the notebooks apply to them."""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from cloudml_lib.base import tables
from cloudml_lib.base.errors import ConfigError
from cloudml_lib.base.outputs import free_bytes
from cloudml_lib.base.resources import PRESET_FILES, config_file, measured
from cloudml_lib.core.machine import estimate, timing
from cloudml_lib.core.machine.device import (
    compile_available,
    default_num_workers,
    driver_cuda_version,
    gpu_report,
    host_memory,
    is_colab,
    torch_build_notice,
)
from cloudml_lib.core.machine.memory import GIB, MARGIN

log = logging.getLogger(__name__)


PRESETS = ("A", "B", "C")


def system_report(paths: dict[str, str] | None = None) -> dict:
    """Everything `diagnose` shows: versions, GPU, host RAM, free disk where the run and cache live, CPUs, and
    why the GPU is unusable where this torch's build is the reason."""
    driver = driver_cuda_version()
    return {
        "colab": is_colab(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver_cuda": driver,  # the highest CUDA the NVIDIA driver supports (None: no driver, or unknown)
        "torch_build_problem": torch_build_notice(driver),
        "gpu": gpu_report(),
        "host_memory": host_memory(),
        "cpus": os.cpu_count(),
        "disk_free": {name: free_bytes(Path(p).resolve()) for name, p in (paths or {}).items()},
        "compile": dict(zip(("available", "reason"), compile_available())),
    }


@dataclass(frozen=True)
class PresetMemory:
    """A preset's GPU memory at its own batch: estimated from the model (estimate.py), or, where this torch
    cannot estimate, the figure the users reported (labelled so wherever it is shown)."""

    name: str
    model: str  # e.g. "64/128/256, checkpointing, compiled"
    batch: int
    estimate: estimate.Estimate | None
    shape: estimate.StepShape | None = None  # the step (as runs record it: timing.signature)

    @property
    def reported_bytes(self) -> float:
        return estimate.REPORTED_PEAK_GIB[self.name] * GIB

    def need(self) -> float:
        """Bytes a training step at the preset's batch needs: the estimate with its overhead, else the
        users' reported figure."""
        return self.estimate.need(self.batch) if self.estimate else self.reported_bytes

    def largest_batch(self, budget: float) -> int:
        """The largest batch that fits `budget` bytes with the 15 % margin (from the reported figure, which
        holds at the preset's batch only, this batch or 0)."""
        if self.estimate:
            return self.estimate.largest_batch(budget)
        return self.batch if self.reported_bytes * (1 + MARGIN) <= budget else 0

    def fits(self, budget: float) -> bool:
        return self.largest_batch(budget) >= self.batch

    def source(self) -> str:
        if self.estimate:
            return "estimated from the model"
        return "reported by users (no estimate on this torch)"


@functools.cache
def preset_memory() -> tuple[PresetMemory, ...]:
    """Presets A, B, C at 440 x 640 (their swath_slice) under fp16 autocast, as on a T4; a few seconds the
    first time, then cached."""
    from cloudml_lib.base.config import load_config

    out = []
    for name in PRESETS:
        cfg = load_config(preset_config_path(name))
        model = "/".join(map(str, cfg.channels)) + (
            ", checkpointing" if cfg.model.gradient_checkpointing else ", no checkpointing"
        )
        model += ", compiled" if cfg.train.torch_compile else ""
        shape = estimate.StepShape.of(cfg, amp="float16")
        out.append(PresetMemory(name, model, int(cfg.train.batch_size), estimate.estimate(shape), shape))
    return tuple(out)


def choose_preset(report: dict) -> tuple[str, str]:
    """Preset A, B or C for the GPU at hand (demo without one), with the reason in plain words: the first
    that fits the free memory at its batch (A only where torch.compile works), by the estimate of each
    preset's peak (preset_memory). C, the narrow model with checkpointing, needs the least; where even it
    does not fit, C it is, and train.batch_size: auto lowers its batch."""
    gpu = report.get("gpu")
    if not gpu:
        return "demo", (
            "no CUDA GPU was found, so the demo configuration is used: a narrow model sized for a CPU, made "
            "for the built-in demo flights (presets A, B and C are for a GPU: hours per epoch on a CPU)"
        )
    free = gpu["free_bytes"]
    presets = {p.name: p for p in preset_memory()}
    a, b, c = presets["A"], presets["B"], presets["C"]
    have = f"{gpu['name']} has {free / GIB:.1f} GiB free"
    compile_ok = report["compile"]["available"]

    def needs(p: PresetMemory) -> str:
        return f"{p.need() / GIB:.1f} GiB at batch {p.batch} + 15% margin, {p.source()}"

    reason = str(report["compile"]["reason"])
    caveat = f"; torch.compile is {reason}" if reason.startswith("available, with") else ""
    if compile_ok and a.fits(free):
        return "A", (
            f"{have}, enough for the full model with torch.compile (preset A needs about {needs(a)}){caveat}"
        )
    not_a = (
        f"torch.compile is not available ({report['compile']['reason']})"
        if not compile_ok
        else f"preset A needs about {needs(a)}"
    )
    if b.fits(free):
        return "B", f"{have}; {not_a}; the full model without compile fits (about {needs(b)})"
    if c.fits(free):
        return "C", (
            f"{have}: the full model does not fit (preset B needs about {needs(b)}); the narrow model with "
            f"checkpointing does (about {needs(c)})"
        )
    room = c.largest_batch(free)
    fits = f"about batch {room} fits, so set train.batch_size: auto (its probe measures the largest batch)"
    return "C", (
        f"{have}: even preset C needs about {needs(c)}; "
        + (fits if room else "not even batch 1 fits")
        + ". Free GPU memory: stop other processes, or restart the runtime"
    )


def memory_rows(free_bytes: float | None, runs: Path | None = None) -> list[list[str]]:
    """The memory table: each preset, its estimated peak at its batch (the tensors, and with the overhead),
    the largest batch that fits this GPU (`free_bytes`; "-" without a GPU) and a T4, what the users
    reported and benchmarks/gpu.py measured; with `runs` (a folder of the user's runs), what their newest
    run with the preset's step measured on this kind of device (timing.measured_words)."""
    rows, here = [], this_device()
    for p in preset_memory():
        e = p.estimate
        row = [
            p.name,
            p.model,
            p.batch,
            f"{e.train_peak(p.batch) / GIB:.2f}" if e else "unavailable",
            f"{p.need() / GIB:.2f}" if e else "-",
            "-" if free_bytes is None else p.largest_batch(free_bytes),
            p.largest_batch(estimate.T4_BYTES),
            f"{estimate.REPORTED_PEAK_GIB[p.name]:.0f}",
            measured_memory(p.name),
        ]
        if runs is not None:
            sig = timing.signature(p.shape, p.batch) if p.shape else None
            row.append(timing.measured_words(runs, here, sig) if sig else "-")
        rows.append(row)
    return rows


def this_device() -> str:
    """The kind of device a run here trains on, as runs record it (timing.device_name)."""
    return timing.device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def measured_gpu() -> dict:
    """benchmarks/gpu.py's results as the package holds them ({} where no GPU has measured them)."""
    d = measured("gpu") or {}
    return d if isinstance(d.get("presets"), dict) else {}


def measured_memory(preset: str) -> str:
    """A preset's peak GPU memory measured by benchmarks/gpu.py at its batch, "allocated / reserved" in
    GiB, or "-"."""
    p = measured_gpu().get("presets", {}).get(preset)
    values = [p.get(k) for k in ("peak_allocated_gib", "peak_reserved_gib")] if isinstance(p, dict) else []
    if len(values) != 2 or not all(isinstance(v, (int, float)) for v in values):
        return "-"
    return f"{values[0]:.2f} / {values[1]:.2f}"


def measured_overhead() -> tuple[float, float] | None:
    """What the largest batch that fitted under benchmarks/gpu.py's cap needed beyond the estimated peak
    (GiB, between these two: that batch fitted, one more did not), from its preset B; None if not measured."""
    gpu = measured_gpu()
    fit = (gpu.get("memory") or {}).get("B") or {}
    largest, cap = fit.get("largest_fitting_batch"), gpu.get("memory_cap_gib")
    e = next((p.estimate for p in preset_memory() if p.name == "B"), None)
    if not (isinstance(largest, int) and largest > 0 and isinstance(cap, (int, float)) and e):
        return None
    return cap - e.train_peak(largest + 1) / GIB, cap - e.train_peak(largest) / GIB


MEMORY_HEADER = [
    "preset",
    "model",
    "batch",
    "estimated peak (GiB)",
    "with overhead (GiB)",
    "largest batch here",
    "largest batch on a T4",
    "reported by users (GiB)",
    "measured, allocated / reserved (GiB)",
]


YOURS = "measured in your runs (this kind of device)"


def memory_header(runs: Path | None = None) -> list[str]:
    return MEMORY_HEADER + ([YOURS] if runs is not None else [])


def memory_table(free_bytes: float | None, markdown: bool = False, runs: Path | None = None) -> str:
    """memory_rows as a table, and what its figures are."""
    rows, header = memory_rows(free_bytes, runs), memory_header(runs)
    body = tables.markdown(header, rows) if markdown else tables.text(header, rows)
    return body + "\n\n" + memory_note(runs)


def memory_note(runs: Path | None = None) -> str:
    """What the memory table's figures are, and where the measured ones come from."""
    gpu, overhead = measured_gpu(), measured_overhead()
    where = (
        f"Measured: benchmarks/gpu.py on an {gpu.get('device')} standing for a T4 (capped at "
        f"{gpu.get('memory_cap_gib')} GiB, fp16 + GradScaler), the same step at the same size; on a T4 the "
        "allocated figure transfers, not the speed."
        if gpu
        else "Measured: no GPU has run benchmarks/gpu.py for this installation, so the overhead is stated."
    )
    if overhead:
        where += (
            f" Under that cap the largest batch that fitted needed the estimated peak + {overhead[0]:.2f} to "
            f"{overhead[1]:.2f} GiB, inside the stated overhead (a T4 also holds its CUDA context)."
        )
    return (
        "Estimated peak: the tensors of one training step at 440 x 640, T = 5, fp16 autocast, weights, "
        "optimizer state and the batch included, computed from the model on fake tensors (nothing "
        f"allocated). With overhead: + {estimate.SLACK:.0%} allocator slack + "
        f"{estimate.OVERHEAD_BYTES / GIB:.2f} GiB for the CUDA context and workspaces. Largest batch: with "
        "the 15% margin that train.batch_size: auto keeps (its probe on the GPU decides). Reported by users: "
        "the figures in their notes, for their own network; they differ from the estimate of this one. "
        + where
        + (
            f" Measured in your runs: the newest run in {runs} with the preset's step (widths, "
            f"checkpointing, 440 x 640, T = 5, its batch) on this kind of device ({this_device()}): its peak "
            "memory and its steps/s, validation included; '-' where none has."
            if runs is not None
            else ""
        )
    )


def preset_config_path(name: str) -> Path:
    """The YAML of a preset, from the package (configs/ in a checkout): never from the working directory."""
    if name not in PRESET_FILES:
        raise ConfigError(f"--preset {name!r}: choose one of auto, {', '.join(PRESET_FILES)}")
    path = config_file(PRESET_FILES[name])
    if path is None:
        raise ConfigError(
            f"preset file {PRESET_FILES[name]} is missing from this CloudML installation; reinstall "
            "it (pip install of the CloudML folder), or pass --config PATH"
        )
    return path


def recommendations(report: dict, cache_bytes: int | None = None) -> list[str]:
    """Plain-words advice from the report."""
    out = []
    preset, why = choose_preset(report)
    out.append(f"Preset: {preset} ({PRESET_FILES[preset]}): {why}.")
    gpu = report.get("gpu")
    if gpu:
        others = [p for p in gpu["processes"] if p["pid"] != os.getpid()]
        if others:
            used = sum(p["used_mib"] or 0 for p in others)
            out.append(
                f"{len(others)} other process(es) hold {used} MiB of GPU memory "
                f"({', '.join(str(p['pid']) for p in others)}); stop them or restart the runtime to free it."
            )
        out.append(
            "Batch size: set train.batch_size: auto to measure the largest batch that fits this GPU "
            "(two probe steps, 15% margin)."
        )
    else:
        out.append(
            "Batch size: the presets' batch sizes are for a GPU; on the CPU use the demo or a small batch."
        )
    workers = default_num_workers(report["colab"], report["cpus"])
    out.append(
        f"DataLoader workers: {workers} ("
        + (
            "Colab: 2 cores and little shared memory; loading in the training process is fastest"
            if report["colab"]
            else f"{report['cpus']} CPUs"
        )
        + ")."
    )
    out.append(preprocessing_advice(bool(gpu)))
    avail = report["host_memory"]["available"]
    if cache_bytes is not None and avail:
        fits = cache_bytes < 0.8 * avail
        out.append(
            f"Preprocessing cache: {cache_bytes / 1e9:.2f} GB; "
            + (
                "it fits in the free RAM, so after the first epoch reads come from the page cache."
                if fits
                else f"larger than 80% of the free RAM ({avail / 1e9:.1f} GB): samples are read "
                "from disk each epoch (memory use stays flat; put the cache on local disk for speed)."
            )
        )
    for name, free in report["disk_free"].items():
        if free is not None and free < 2 * GIB:
            out.append(
                f"Only {free / GIB:.1f} GiB free on the disk of the {name} folder: checkpoints and the cache "
                "may not fit; free space or choose another folder."
            )
    return out


def preprocessing_advice(gpu: bool) -> str:
    """Where the frames' CLAHE will run with data.preprocess_device: auto."""
    from cloudml_lib.data.preprocess import available_cores

    cores = available_cores()
    if gpu:
        return (
            "Preprocessing: CLAHE on the GPU (torch, scikit-image's frames bit for bit), frames read by "
            f"{cores} worker processes."
        )
    return f"Preprocessing: {cores} worker processes (one per core this process may use), scikit-image."


def format_machine(report: dict) -> str:
    lines = [
        f"Environment: {'Google Colab' if report['colab'] else 'local'}; Python {report['python']}, "
        f"torch {report['torch']}, CUDA {report['cuda'] or 'none'}"
        + (f" (the driver's: up to {report['driver_cuda']})" if report.get("driver_cuda") else "")
        + f"; {report['cpus']} CPUs"
    ]
    if report.get("torch_build_problem"):
        lines.append(f"GPU unusable: {report['torch_build_problem']}")
    gpu = report["gpu"]
    if gpu:
        lines.append(
            f"GPU: {gpu['name']} (compute capability {gpu['compute_capability']}), "
            f"{gpu['free_bytes'] / GIB:.1f} of {gpu['total_bytes'] / GIB:.1f} GiB free; torch.compile: "
            f"{report['compile']['reason']}"
        )
        for p in gpu["processes"]:
            lines.append(f"  GPU process {p['pid']} {p['name']}: {p['used_mib']} MiB")
    else:
        lines.append("GPU: none (training runs on the CPU)")
    mem = report["host_memory"]
    lines.append(f"Host RAM: {mem['available'] / GIB:.1f} of {mem['total'] / GIB:.1f} GiB available")
    for name, free in report["disk_free"].items():
        lines.append(
            f"Free disk for the {name} folder: " + (f"{free / GIB:.1f} GiB" if free is not None else "?")
        )
    return "\n".join(lines)
