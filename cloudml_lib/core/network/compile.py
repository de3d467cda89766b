"""torch.compile, applied from outside the model, and what it did.

What is compiled: the frame encoder (three conv blocks and the spatial attention, run once per frame:
nearly all of the model's arithmetic), in place (`encoder.forward = torch.compile(encoder.forward)`),
so the module, its parameters and its state-dict keys stay the same (no `_orig_mod.`), and gradient
checkpointing stays around it in eager mode with its BatchNorm context (model.py): running statistics
are updated once per step, gradients equal eager ones to float rounding. Chosen by measurement
against compiling the whole model with the checkpoint traced inside (benchmarks/compile.py, CPU):
the region compiles about 3x faster (17 s against 55 s cold), steps faster (1.06x eager for the full
model against 0.93x) and keeps less for backward; both have one graph and no graph break.

When: `train.torch_compile: true` compiles on any device. On a CPU the run says what compiling measured
there (a modest gain that pays off after a few hundred steps); without a C++ compiler inductor fails
and the run falls back to eager. What happened is never silent: `CompileReport` counts graphs, graph
breaks (with their reasons), recompiles and compile seconds from Dynamo's counters; the trainer logs
it after the first step, writes it to run.json (status and report.md read it), and a failure falls
back to eager with a warning (recovery.py).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from cloudml_lib.base.config import CUDA_GRAPH_COMPILE_MODES, cuda_graph_refusal
from cloudml_lib.base.errors import ConfigError
from cloudml_lib.base.resources import measured
from cloudml_lib.core.network.compile_cache import CompileCache

log = logging.getLogger(__name__)

WHAT = "the frame encoder (3 conv blocks + spatial attention, once per frame)"
# Compiling the frame encoder inside gradient checkpointing (preset A) needs this torch release, by public
# reports; pyproject.toml's floor (2.3) is lower, so older releases run such a model eager, with a warning.
CHECKPOINTED_COMPILE_TORCH = (2, 10)


def torch_release() -> tuple[int, int]:
    """(major, minor) of the torch in use, e.g. (2, 11) for "2.11.0+cu128"."""
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (99, 0)  # an unparseable (development) version: assume a new one


def cpu_ratio() -> str:
    """What compiling measured on a CPU, in words (benchmarks/compile.py, the frame encoder compiled)."""
    d = measured("compile")
    try:
        demo, full = d["demo"]["region_ckpt"], d["full"]["region_ckpt"]
        return (
            f"on a CPU ({d['machine']['cpu']}, {d['machine']['cores']} cores) compiled steps measured "
            f"{demo['speed_vs_eager']:.2f}x eager's speed for the demo model and "
            f"{full['speed_vs_eager']:.2f}x "
            f"for the full model, after {full['compile_s']:.0f} s of compiling: it pays off after about "
            f"{full['break_even_steps'] or 0:,} steps of the full model"
        )
    except (KeyError, TypeError):
        return "on a CPU, see benchmarks/compile.py for what compiling gains"


def this_device() -> torch.device:
    """The device a run with train.device: auto would use here."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def plan(setting, mode: str, device: torch.device) -> str:
    """What train.torch_compile will do on `device`, in a few words (preset table, picker)."""
    if not setting:
        return "off"
    if device.type == "cuda":
        return f"on: the frame encoder, mode {mode!r}; the first step also compiles (tens of seconds)"
    return f"on, on this CPU: the frame encoder ({cpu_ratio()})"


@dataclass
class CompileReport:
    """What torch.compile did in this run (written to run.json under "compile")."""

    requested: bool = False
    active: bool = False  # compiled now (False after a fall-back to eager)
    what: str = ""
    mode: str = ""
    why: str = ""  # why it is on or off
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: list = field(default_factory=list)
    recompiles: int = 0
    compile_s: float = 0.0
    fallback: str = ""  # the error that sent the run back to eager
    cache: str = ""  # the kept kernels: where, and whether any were there (compile_cache.py)
    cache_hits: int = 0  # compiled graphs inductor took from its cache instead of compiling

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        if self.fallback:
            return f"not compiled: torch.compile failed ({self.fallback}); the run continued in eager mode"
        if not self.active:
            return f"not compiled ({self.why})"
        breaks = (
            "no graph break"
            if not self.graph_breaks
            else f"{self.graph_breaks} graph break(s): {'; '.join(self.break_reasons[:3])}"
        )
        kept = f", {self.cache_hits} graph(s) from the kept kernels" if self.cache_hits else ""
        return (
            f"compiled {self.what} with torch.compile(mode={self.mode!r}): {self.graphs} graph(s), {breaks}, "
            f"{self.recompiles} recompile(s), {self.compile_s:.1f} s of compiling{kept}"
        )


def describe_saved(d: dict | None) -> str:
    """CompileReport.describe() of what a run wrote to run.json (older runs have no "compile")."""
    if not isinstance(d, dict):
        return "not recorded (a run started before CloudML reported compiling)"
    known = {k: v for k, v in d.items() if k in CompileReport.__dataclass_fields__}
    return CompileReport(**known).describe()


def _counters() -> dict:
    """Dynamo's process-wide counters, as plain numbers (private API: anything missing reads as zero)."""
    try:
        from torch._dynamo.utils import compile_times, counters

        names, values = compile_times(repr="csv")
        seconds = sum(
            float(x)
            for name, row in zip(names, values)
            if name == "_compile.compile_inner"
            for x in row.split(",")
        )
        return {
            "hits": counters["inductor"].get("fxgraph_cache_hit", 0),
            "graphs": counters["stats"].get("unique_graphs", 0),
            "frames": counters["frames"].get("ok", 0),
            "breaks": dict(counters["graph_break"]),
            "seconds": seconds,
        }
    except Exception:  # noqa: BLE001 - the report is best effort; compiling itself does not depend on it
        return {"hits": 0, "graphs": 0, "frames": 0, "breaks": {}, "seconds": 0.0}


class CompileWatch:
    """Turns Dynamo's process-wide counters into this run's CompileReport (differences since apply); keeps
    what was compiled in the lasting cache folder, if the run has one (`keep_cache`)."""

    def __init__(self, report: CompileReport, cache: CompileCache | None = None):
        # Dynamo's counters only where the run compiles: an eager run has nothing to count
        self.report, self.cache = report, cache
        self.start = _counters() if report.active else {}
        self._kept_at: tuple | None = None  # Dynamo's (graphs, frames) when the kernels were last kept

    def keep_cache(self) -> None:
        """Copy what was compiled since to the lasting folder (after compiling: the first step, an epoch)."""
        if self.cache is None or not self.report.active:
            return
        now = _counters()
        compiled = (now["graphs"], now["frames"])  # nothing new compiled: no listing of a Drive folder
        if compiled != self._kept_at:
            self.cache.keep()
            self._kept_at = compiled

    def update(self) -> CompileReport:
        if not self.report.active:
            return self.report
        now, r = _counters(), self.report
        r.graphs = now["graphs"] - self.start["graphs"]
        reasons = {k: v - self.start["breaks"].get(k, 0) for k, v in now["breaks"].items()}
        r.break_reasons = sorted(k for k, v in reasons.items() if v > 0)
        r.graph_breaks = sum(v for v in reasons.values() if v > 0)
        r.recompiles = max(0, now["frames"] - self.start["frames"] - 1)
        r.compile_s = now["seconds"] - self.start["seconds"]
        r.cache_hits = now["hits"] - self.start["hits"]
        return r


def apply_compile(
    model: torch.nn.Module, setting, mode: str, device: torch.device, cache_dir: Path | None = None
) -> CompileWatch:
    """Compile the frame encoder of `model` (the unwrapped module) in place when `setting` asks for it;
    `cache_dir`: the lasting folder of compiled kernels (compile_cache.py), None to keep inductor's own."""
    if setting and mode in CUDA_GRAPH_COMPILE_MODES and getattr(model, "grad_checkpointing", False):
        raise ConfigError(cuda_graph_refusal(mode))  # the config refuses it first; this guards direct use
    report = CompileReport(
        requested=bool(setting),
        active=bool(setting),
        what=WHAT if setting else "",
        mode=mode,
        why=f"train.torch_compile is {'on' if setting else 'off'}",
    )
    if not setting:
        return CompileWatch(report)
    if getattr(model, "grad_checkpointing", False) and torch_release() < CHECKPOINTED_COMPILE_TORCH:
        report.active, report.what = False, ""
        report.why = (
            f"torch {torch.__version__} is older than {'.'.join(map(str, CHECKPOINTED_COMPILE_TORCH))}, the "
            "first release that compiles a region inside gradient checkpointing reliably; the run is eager "
            "(the same results, without compile's speed-up)"
        )
        log.warning("Not compiled: %s. A newer torch (pip install -U torch) compiles it.", report.why)
        return CompileWatch(report)
    if device.type != "cuda":
        log.info(
            "torch.compile on the CPU: %s. It needs a C++ compiler (without one the run falls back to "
            "eager). "
            "Set train.torch_compile: false to run eager.",
            cpu_ratio(),
        )
    # Dynamo keeps compiled code per code object, guarded on the module: every earlier model of this
    # process (cross-validation folds, tests) would count against its recompile limit, after which it
    # silently runs eager. Start from a clean slate; inductor's disk cache keeps recompiling cheap.
    torch._dynamo.reset()
    cache = None
    if cache_dir is not None:
        cache = CompileCache(cache_dir)
        report.cache = cache.open()
        log.info("torch.compile: %s", report.cache)
    encoder = model.encoder
    # dynamic=False: each batch shape gets its own static kernels, whatever order the shapes come in, so a
    # resumed run (which may meet the short last batch first, or never) computes bit for bit as an
    # uninterrupted one; automatic dynamic shapes would switch kernels after the first shape change
    encoder.forward = torch.compile(
        encoder.forward, mode=mode, dynamic=False
    )  # instance attribute: keys unchanged
    log.info("compiling %s with torch.compile(mode=%r); the first steps are slow", WHAT, mode)
    return CompileWatch(report, cache)


def undo_compile(model: torch.nn.Module, watch: CompileWatch, failure: str) -> None:
    """Back to eager after a compile failure: the class's own forward again; nothing else changes."""
    if "forward" in vars(model.encoder):
        del model.encoder.forward
    watch.update()
    watch.report.active, watch.report.fallback = False, failure
    try:
        torch._dynamo.reset()
    except Exception:  # noqa: BLE001 - clearing compile caches is best effort
        pass


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile / DataParallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model
