"""CloudML's benchmarks: `python -m benchmarks` runs them all and writes benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import platform

# How a results file's test numbers were obtained (a file without it: CloudML 0.2's protocol, the epoch chosen
# on the flight the numbers are on)
PROTOCOL = "test flight untouched: the epoch chosen on validation data of the training flights (CloudML 0.3)"
OLD_PROTOCOL = (
    "measured under CloudML 0.2's protocol: the best epoch chosen on the flight these numbers are on, so "
    "they are "
    "optimistic (see the selection benchmark)"
)


def protocol_of(d: dict) -> str:
    """The protocol a results file's numbers were obtained under, in words."""
    return d.get("protocol") or OLD_PROTOCOL


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
