"""CloudML's benchmarks: `python -m benchmarks` runs them all and writes benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import platform


def machine() -> dict:
    """What every results file states about where it was measured."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    out = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import lightning

        out["lightning"] = lightning.__version__
    except ImportError:
        pass
    return out


def describe(m: dict | str) -> str:
    """One line for RESULTS.md (older results files hold a plain string)."""
    if isinstance(m, str):
        return m
    extra = "".join(f", {k} {m[k]}" for k in ("gpu", "lightning") if k in m)
    return f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, Python {m['python']}{extra}"
