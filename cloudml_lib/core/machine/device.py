"""The machine: the device and the precision a run uses (and the autocast that applies it), what the GPU and
the host have (memory, other processes, compile support), whether this torch's CUDA build can use the GPU's
driver at all, and the peak-memory readings of the epoch line.
Which preset and batch to use on it is a policy of the commands (commands/presets.py); the batch probe of
`train.batch_size: auto` is memory.py's."""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch

from cloudml_lib.base.errors import ConfigError
from cloudml_lib.core.machine.memory import GIB


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: full fp32) and whether fp16 loss scaling is needed."""

    dtype: torch.dtype | None
    use_grad_scaler: bool

    @property
    def name(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]

    def autocast(self, device: torch.device):
        """A factory of the context a forward pass runs in on `device`: autocast to this dtype, or nothing in
        fp32 (so that the loops have no precision branches)."""
        return partial(torch.autocast, device.type, dtype=self.dtype) if self.dtype else nullcontext


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


# Colab's own torch (constraints/colab.txt, what the tests' Colab twin installs): the build to go back to
# there. A test checks that the two agree.
COLAB_TORCH = "2.11.0+cu128"
TORCH_BUILDS = "https://pytorch.org/get-started/locally/"


def _cuda_tuple(version: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(version).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def torch_build_problem(
    torch_version: str,
    torch_cuda: str | None,
    driver_cuda: str | None,
    *,
    gpu_visible: bool | None = None,
    driver_present: bool = False,
    colab: bool = False,
) -> str | None:
    """Plain words when this torch cannot use the machine's NVIDIA GPU because of how it was built, and the
    way back; None when the GPU works, there is none, or too little is known to say.

    `torch_cuda`: the CUDA torch was built for (torch.version.cuda, None for a CPU-only build); `driver_cuda`:
    the highest CUDA the driver supports (None: unknown). A build of a newer major CUDA never runs on the
    driver (`pip install -U torch` on Colab brings a CUDA 13 build to a CUDA 12 driver); a newer minor one
    often does (CUDA's minor-version compatibility), so it is named only when torch finds no GPU."""
    if gpu_visible:
        return None
    built, driver = _cuda_tuple(torch_cuda), _cuda_tuple(driver_cuda)
    if torch_cuda is None:
        if not (driver_present or driver):
            return None
        what = f"torch {torch_version} is a CPU-only build: it cannot use this machine's NVIDIA GPU."
    elif built and driver and (built[0] > driver[0] or (built > driver and gpu_visible is False)):
        what = (
            f"torch {torch_version} is built for CUDA {torch_cuda}, but this machine's NVIDIA driver "
            f"supports CUDA up to {driver_cuda}: this torch cannot use the GPU."
        )
    elif driver is None and driver_present and gpu_visible is False:
        what = (
            f"torch {torch_version} (built for CUDA {torch_cuda}) finds no GPU although an NVIDIA driver is "
            "installed: the driver is probably older than this build needs."
        )
    else:
        return None
    return f"{what} {_way_back(colab, driver_cuda)}"


def _way_back(colab: bool, driver_cuda: str | None) -> str:
    if colab:
        release, build = COLAB_TORCH.split("+")
        return (
            "On Colab, Runtime > Restart session keeps the torch that pip installed; to get Colab's own "
            "torch back, choose Runtime > Disconnect and delete runtime (a fresh VM with Colab's packages), "
            f"or run `pip install torch=={release} --index-url https://download.pytorch.org/whl/{build}` and "
            "then Runtime > Restart session."
        )
    limit = f"CUDA {driver_cuda} or older" if driver_cuda else "the CUDA version nvidia-smi shows"
    return f"Install a torch built for {limit} ({TORCH_BUILDS} gives the command), or update the driver."


def nvidia_driver_present() -> bool:
    return os.path.isdir("/proc/driver/nvidia") or shutil.which("nvidia-smi") is not None


def driver_cuda_version() -> str | None:
    """The highest CUDA version the NVIDIA driver supports ("12.8"): libcuda's cuDriverGetVersion (needs no
    GPU context), else nvidia-smi's "CUDA Version"; None wherever neither answers."""
    try:
        found = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(found)) == 0 and found.value > 0:
            return f"{found.value // 1000}.{found.value % 1000 // 10}"
    except Exception:  # no libcuda, another platform, a broken install: unknown, never an error
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CUDA Version:\s*(\d+\.\d+)", out)
    return m.group(1) if m else None


def torch_build_notice(driver_cuda: str | None = None) -> str | None:
    """torch_build_problem on this machine's facts (the driver's CUDA read here unless given); never
    raises."""
    try:
        visible = torch.cuda.is_available()
    except Exception:  # a torch whose CUDA cannot even be asked: unknown
        visible = None
    return torch_build_problem(
        torch.__version__,
        torch.version.cuda,
        driver_cuda or driver_cuda_version(),
        gpu_visible=visible,
        driver_present=nvidia_driver_present(),
        colab=is_colab(),
    )


def compile_available() -> tuple[bool, str]:
    """Whether torch.compile can generate GPU kernels here (Triton, compute capability >= 7.0)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if importlib.util.find_spec("triton") is None:
        return False, "Triton is not installed"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 7:
        return False, f"compute capability {major}.{minor} is below 7.0"
    if major < 8:  # a T4 (7.5), a V100 (7.0)
        return True, (
            f"available, with a caveat: Triton officially supports compute capability 8.0 and up since "
            f"3.3, and this GPU has {major}.{minor} (its matrix kernels fall back to slower ones; CloudML's "
            "compiled encoder was measured at 2.4x eager's step on an H200, not on this GPU); a compile "
            "failure falls back to eager from the same step"
        )
    return True, "available"


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
