"""`train.deterministic`: the same numbers on a GPU, run after run and across a resume.

On the CPU a run is deterministic as it is: a run killed and resumed ends bit-identical to one never
interrupted (tests/test_resume.py). On a GPU it is not, unless asked: cuDNN chooses among convolution
algorithms, some of which add in a varying order, and cuBLAS splits its work by a workspace; a resumed run
then equals the uninterrupted one to rounding, not bit for bit, and two runs of one config differ as much.
`train.deterministic: true` switches all of that off:

- `torch.use_deterministic_algorithms(True, warn_only=True)`: an operation that has no deterministic version
  warns (once) instead of stopping the run;
- `torch.backends.cudnn.deterministic = True` and `cudnn.benchmark = False`: cuDNN's fixed algorithms;
- `CUBLAS_WORKSPACE_CONFIG=:4096:8` (when not set already), which cuBLAS needs for repeatable matmuls.

The cost is speed on a GPU only: cuDNN may not take its fastest algorithm (not measured yet: no GPU was lent
since the switch exists); on a CPU the switch changes nothing. With these switches, a run
killed and resumed on an H200 ended bit-identical to the uninterrupted one (benchmarks/results/gpu.json,
the resume item).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

CUBLAS_ENV, CUBLAS_SETTING = "CUBLAS_WORKSPACE_CONFIG", ":4096:8"


def apply_determinism(on: bool, device: torch.device) -> str:
    """Set (or leave) the deterministic switches for this process; returns what a run of `device` gets, in
    words, for the log and run.json."""
    if not on:
        if device.type == "cuda":
            return (
                "off: a resumed run equals an uninterrupted one to rounding, not bit for bit "
                "(train.deterministic: true makes them equal, at some speed)"
            )
        return "off (on the CPU a run is deterministic anyway)"
    os.environ.setdefault(CUBLAS_ENV, CUBLAS_SETTING)  # read when cuBLAS starts: before the first matmul
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if device.type == "cuda":
        return (
            "on: deterministic algorithms, cuDNN's fixed ones (a little slower); a resumed run equals an "
            "uninterrupted one bit for bit"
        )
    return "on (on the CPU it changes nothing: a run is deterministic anyway)"


def reset_determinism() -> None:
    """Back to torch's defaults (a process that goes on after a deterministic run: the tests)."""
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
