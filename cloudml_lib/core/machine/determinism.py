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


_before_ours: dict | None = None  # torch's switches as they were when a run of this process switched them on


def _switches() -> dict:
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": torch.backends.cudnn.deterministic,
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "cublas": os.environ.get(CUBLAS_ENV),
    }


def _restore(state: dict) -> None:
    torch.use_deterministic_algorithms(state["algorithms"], warn_only=state["warn_only"])
    torch.backends.cudnn.deterministic = state["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = state["cudnn_benchmark"]
    if state["cublas"] is None:
        os.environ.pop(CUBLAS_ENV, None)
    else:
        os.environ[CUBLAS_ENV] = state["cublas"]


def apply_determinism(on: bool, device: torch.device) -> str:
    """Set (or leave) the deterministic switches for this process; returns what a run of `device` gets, in
    words, for the log and run.json.

    The switches are global to the process: they last for the run (`restore_determinism` at its end), and a
    run with the switch off after one with it on in the same process (a notebook's kernel) gets them as they
    were before, so its log says the truth. Switches the user set in the process before any run are theirs:
    left as they are, and said."""
    global _before_ours
    if not on:
        restore_determinism()
        if torch.are_deterministic_algorithms_enabled():
            return (
                "off in the config, but torch's deterministic algorithms were switched on in this process "
                "before the run (torch.use_deterministic_algorithms): left on"
            )
        if device.type == "cuda":
            return (
                "off: a resumed run equals an uninterrupted one to rounding, not bit for bit "
                "(train.deterministic: true makes them equal, at some speed)"
            )
        return "off (on the CPU a run is deterministic anyway)"
    if _before_ours is None:
        _before_ours = _switches()
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


def restore_determinism() -> None:
    """Torch's switches back as they were before a run of this process switched them on (the end of that
    run: a notebook's kernel goes on with its own settings); nothing where no run did."""
    global _before_ours
    if _before_ours is not None:
        _restore(_before_ours)
        _before_ours = None


def reset_determinism() -> None:
    """Back to torch's defaults (a process that goes on after a deterministic run: the tests)."""
    global _before_ours
    _before_ours = None
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
