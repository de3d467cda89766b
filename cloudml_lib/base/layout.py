"""A run folder's layout: every file and folder name a run writes, written here once.

`RunLayout(path)` names the places of one run folder (`RunLayout(run_dir).best` is its best.pt); the class's
constants are the names, for what lists or reads them by name (runfiles.py, the ledger's rule, status). The
run folder as an object that CloudML claims, locks, resumes, reads and writes is `RunFolder`
(core/run/folder.py), built on this layout; the layers below core know only the layout. What each file
holds, and who writes it: docs/reference/run-folder.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, eq=False)
class RunLayout:
    """One run folder's places, from its path (a `str`, a `Path` or another layout). A layout is a path-like
    object (`os.fspath`, `Path(layout)`, `open`), so it goes wherever a folder's path goes. Two layouts of
    one path are one folder, whatever their class (a `RunFolder` is a layout too): equal, hashed alike and
    sorted by path; a layout is never equal to a bare path."""

    path: Path

    BEST = "best.pt"  # the best model
    CONFIG = "config.yaml"  # the run's plan, as it trains
    METRICS = "metrics.jsonl"  # a record per logged step, epoch and end
    RUN_INFO = "run.json"  # this start's plan, what compile did, the measurements, a failure
    LOG = "train.log"
    REPORT = "report.md"
    EVALUATION = "evaluation.json"  # the end's numbers; its presence marks the end as done
    INTERVALS = "intervals.json"  # the calibration of the prediction intervals
    PROVENANCE = "provenance.json"  # what the run was trained on
    PREDICTIONS = "predictions.csv"
    TRIAL = "trial.json"  # a sweep trial's parameters and state
    PLOTS = "plots"
    CHECKPOINTS = "checkpoints"
    TENSORBOARD = "tensorboard"
    REJECTED = "rejected"  # committed checkpoints that failed verification, kept for inspection
    PRETRAIN = "pretrain"  # phase 1 of the two-phase protocol, a run of its own inside the run
    COMPILE_CACHE = "compile_cache"  # torch.compile's kernels, kept for the next machine (compile_cache.py)

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    def __fspath__(self) -> str:
        return str(self.path)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunLayout) and self.path == other.path

    def __hash__(self) -> int:
        return hash(self.path)

    def __lt__(self, other: RunLayout) -> bool:
        return self.path < other.path

    def __str__(self) -> str:
        return str(self.path)

    @property
    def compile_cache(self) -> Path:
        return self.path / self.COMPILE_CACHE

    @property
    def best(self) -> Path:
        return self.path / self.BEST

    @property
    def config(self) -> Path:
        return self.path / self.CONFIG

    @property
    def metrics(self) -> Path:
        return self.path / self.METRICS

    @property
    def run_info(self) -> Path:
        return self.path / self.RUN_INFO

    @property
    def log(self) -> Path:
        return self.path / self.LOG

    @property
    def report(self) -> Path:
        return self.path / self.REPORT

    @property
    def newest_report(self) -> Path:
        """report.md, or report.new.md where CloudML wrote its report there since (a user edited report.md:
        outputs.target) and it is the newer of the two."""
        new = self.path / f"{Path(self.REPORT).stem}.new.md"
        try:
            if new.is_file() and new.stat().st_mtime >= self.report.stat().st_mtime:
                return new
        except OSError:
            pass
        return self.report

    @property
    def evaluation(self) -> Path:
        return self.path / self.EVALUATION

    @property
    def intervals(self) -> Path:
        return self.path / self.INTERVALS

    @property
    def provenance(self) -> Path:
        return self.path / self.PROVENANCE

    @property
    def predictions(self) -> Path:
        return self.path / self.PREDICTIONS

    @property
    def trial(self) -> Path:
        return self.path / self.TRIAL

    @property
    def plots(self) -> Path:
        return self.path / self.PLOTS

    @property
    def checkpoints(self) -> Path:
        return self.path / self.CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.path / self.TENSORBOARD

    @property
    def rejected(self) -> Path:
        return self.path / self.REJECTED

    @property
    def pretrain(self) -> Path:
        return self.path / self.PRETRAIN
