"""The machine: device and precision choice, a report of GPU and host memory, presets by GPU, and
peak-memory readings for the epoch line (the batch probe of `train.batch_size: auto` is memory.py's)."""

from __future__ import annotations

import functools
import gc
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from cloudml_lib import estimate, tables
from cloudml_lib.errors import ConfigError
from cloudml_lib.memory import GIB, MARGIN
from cloudml_lib.outputs import free_bytes
from cloudml_lib.resources import PRESET_FILES, config_file, measured

log = logging.getLogger(__name__)

PRESETS = ("A", "B", "C")


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: full fp32) and whether fp16 loss scaling is needed."""

    dtype: torch.dtype | None
    use_grad_scaler: bool

    @property
    def name(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]


def choose_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "train.device: 'cuda' was asked for but no CUDA GPU is visible; use 'auto' or 'cpu' "
            "(on Colab: Runtime > Change runtime type > GPU)"
        )
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def choose_precision(device: torch.device) -> Precision:
    """fp16 + GradScaler before compute capability 8 (T4, V100), bf16 from 8 (A100, H100), fp32 on CPU."""
    if device.type != "cuda":
        return Precision(None, False)
    major, _ = torch.cuda.get_device_capability(device)
    return Precision(torch.bfloat16, False) if major >= 8 else Precision(torch.float16, True)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / GIB:.1f} GiB, compute capability {p.major}.{p.minor})"
    return f"CPU ({torch.get_num_threads()} threads)"


# ------------------------------------------------------------------------------ the report


def is_colab() -> bool:
    if "COLAB_RELEASE_TAG" in os.environ or "google.colab" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("google.colab") is not None
    except (ImportError, ValueError):  # no "google" package at all
        return False


def default_num_workers(colab: bool | None = None, cpus: int | None = None) -> int:
    """0 on Colab (2 cores, little shared memory: workers cost RAM and gain nothing); else up to 4."""
    if is_colab() if colab is None else colab:
        return 0
    return max(0, min(4, (cpus or os.cpu_count() or 1) - 1))


def host_memory() -> dict:
    """Total and available RAM in bytes, from /proc/meminfo (0 where that does not exist)."""
    info = {}
    try:
        for line in open("/proc/meminfo"):
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return {"total": info.get("MemTotal", 0), "available": info.get("MemAvailable", 0)}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; reset by exec, unlike ru_maxrss)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gpu_processes() -> list[dict]:
    """Processes holding GPU memory, from nvidia-smi when it exists."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid,process_name,used_memory",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    procs = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            procs.append(
                {
                    "pid": int(parts[0]),
                    "name": parts[1],
                    "used_mib": int(parts[2]) if parts[2].isdigit() else None,
                }
            )
    return procs


def gpu_report() -> dict | None:
    if not torch.cuda.is_available():
        return None
    p = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    return {
        "name": p.name,
        "compute_capability": f"{p.major}.{p.minor}",
        "total_bytes": total,
        "free_bytes": free,
        "allocated_by_this_process": torch.cuda.memory_allocated(0),
        "processes": gpu_processes(),
    }


def compile_available() -> tuple[bool, str]:
    """Whether torch.compile can generate GPU kernels here (Triton, compute capability >= 7.0)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 7:
        return False, f"compute capability {major}.{minor} is below 7.0"
    return True, "available"


def system_report(paths: dict[str, str] | None = None) -> dict:
    """Everything `diagnose` shows: versions, GPU, host RAM, free disk where the run and cache live, CPUs."""
    return {
        "colab": is_colab(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
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
    from cloudml_lib.config import load_config

    out = []
    for name in PRESETS:
        cfg = load_config(preset_config_path(name))
        model = "/".join(map(str, cfg.channels)) + (
            ", checkpointing" if cfg.model.gradient_checkpointing else ", no checkpointing"
        )
        model += ", compiled" if cfg.train.torch_compile else ""
        shape = estimate.StepShape.of(cfg, amp="float16")
        out.append(PresetMemory(name, model, int(cfg.train.batch_size), estimate.estimate(shape)))
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

    if compile_ok and a.fits(free):
        return "A", f"{have}, enough for the full model with torch.compile (preset A needs about {needs(a)})"
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


def memory_rows(free_bytes: float | None) -> list[list[str]]:
    """The memory table: each preset, its estimated peak at its batch (the tensors, and with the overhead),
    the largest batch that fits this GPU (`free_bytes`; "-" without a GPU) and a T4, and what the users
    reported."""
    rows = []
    for p in preset_memory():
        e = p.estimate
        rows.append(
            [
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
        )
    return rows


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


def memory_table(free_bytes: float | None, markdown: bool = False) -> str:
    """memory_rows as a table, and what its figures are."""
    rows = memory_rows(free_bytes)
    body = tables.markdown(MEMORY_HEADER, rows) if markdown else tables.text(MEMORY_HEADER, rows)
    return body + "\n\n" + memory_note()


def memory_note() -> str:
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
    """Where the frames' CLAHE will run with data.preprocess_device: auto, and how to move it to the GPU."""
    from cloudml_lib.data.preprocess import available_cores, has_kornia
    from cloudml_lib.errors import install_command

    cores = available_cores()
    if gpu and has_kornia():
        return f"Preprocessing: CLAHE on the GPU (kornia), frames read by {cores} worker processes."
    return f"Preprocessing: {cores} worker processes (one per core this process may use), scikit-image." + (
        f" {install_command('kornia')} to equalise the frames on the GPU (data.preprocess_device: auto then "
        "uses it; "
        "its frames differ slightly from scikit-image's, see the README)."
        if gpu
        else ""
    )


def format_machine(report: dict) -> str:
    lines = [
        f"Environment: {'Google Colab' if report['colab'] else 'local'}; Python {report['python']}, "
        f"torch {report['torch']}, CUDA {report['cuda'] or 'none'}; {report['cpus']} CPUs"
    ]
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


def release_gpu_memory() -> str:
    """Release cached GPU memory of this process (the notebook's clean-up cell)."""
    gc.collect()
    if not torch.cuda.is_available():
        return "No GPU: nothing to free."
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    return (
        f"Released {(before - torch.cuda.memory_reserved()) / GIB:.2f} GiB held by this process; "
        f"{free / GIB:.1f} of {total / GIB:.1f} GiB free. Memory held by other processes is freed only by "
        "stopping them (Runtime > Restart session)."
    )


def memory_readings(device: torch.device) -> dict:
    """Peak memory since the last reset, for the epoch line and metrics.jsonl; resets the peak."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out = {
            "peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        }
        torch.cuda.reset_peak_memory_stats(device)
        return out
    return {"peak_rss_gib": peak_rss_bytes() / GIB}


def format_memory(m: dict) -> str:
    if "peak_allocated_gib" in m:
        return (
            f"GPU peak {m['peak_allocated_gib']:.1f}/{m['peak_reserved_gib']:.1f} GiB alloc/reserved, "
            f"{m['alloc_retries']} retries"
        )
    return f"peak RSS {m['peak_rss_gib']:.2f} GiB"
