"""`RunFolder`: one run folder as the object the rest of CloudML takes, never a bare path.

It is the layout (base/layout.py: every place a run writes, named once) and, in one method each, what
CloudML does with such a folder: check its kind and claim it, lock it, find the checkpoint a run resumes
from or the one it was trained to, say where it stands (the run states of status.py), read its files as
untrusted (base/runfiles.py), and write run.json and the metrics through their one writer each. A run, a
fold, a trial, a cross-validation and a sweep are each passed as their `RunFolder`, never as a bare path: the
rules in the modules beside it (runfolder.py, resume.py, status.py, checkpoint.py, runlock.py, events.py,
provenance.py) take the object by its layout (`RunLayout`, the same object seen from below core), and the
end, evaluate, predict, reports, compare, cross-validation and sweeps take the `RunFolder`. A path comes in
only at a few doors, each named in tests/test_layout.py (RUN_PATH_TAKERS): the Python API, the library's
entry points (`RunFolder.of(x)` makes one from a path, or returns `x`), the kinds' proofs that
base/ownership.py calls with a path, and the notebooks' helpers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.ownership import Kind
from cloudml_lib.base.ownership import claim as claim_folder
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.run import resume, runfolder, status
from cloudml_lib.core.run.checkpoint import Found, find_latest_valid
from cloudml_lib.core.run.runlock import RunLock

if TYPE_CHECKING:
    from cloudml_lib.core.machine.distributed import Dist


class RunFolder(RunLayout):
    """A run folder: its places (`RunLayout`), and each thing CloudML does with it."""

    @classmethod
    def of(cls, where: RunFolder | str | os.PathLike) -> RunFolder:
        """`where` itself when it is a RunFolder, else the RunFolder at that path (as given: the checks
        resolve `..` and links before they decide, base/ownership.py)."""
        return where if isinstance(where, RunFolder) else cls(Path(where))

    # -------------------------------------------------------------------------- kind and claim

    def check_run(self, trains: bool, command: str) -> None:
        """Refuse a folder that is not a run's (a sweep's, a cross-validation's), naming the kind it is;
        `trains`: refuse too a folder that is not CloudML's and a link where a run writes a file. `command`:
        the caller's name, for the example the refusal gives."""
        runfolder.check_run_kind(self, trains, command)

    def check_crossval(self) -> None:
        """Refuse a folder that is not a cross-validation's (a sweep's, a training run's) or not CloudML's,
        and a link where it writes a file."""
        runfolder.check_crossval_kind(self)

    def claim(self, kind: Kind) -> None:
        """Made (or adopted) and marked as CloudML's folder of `kind`, before anything is written in it."""
        claim_folder(self.path, kind)

    def lock(self) -> RunLock:
        """This process's lock on the folder, taken (RunLock.release() gives it back)."""
        held = RunLock(self)
        held.acquire()
        return held

    def clean_leftovers(self) -> list[str]:
        """Unfinished writes of killed processes, removed where the ledger proves them CloudML's."""
        return runfolder.clean_leftovers(self)

    # -------------------------------------------------------------------------- checkpoints

    def resume_point(self, mode: str) -> Found | None:
        """The checkpoint a run continues from by --resume auto|never|PATH (None: start afresh)."""
        return resume.find_resume_point(self, mode)

    def trained_checkpoint(self) -> Found:
        """The newest valid checkpoint of a run trained to its end, loaded (its end starts from it)."""
        found = find_latest_valid(self)
        if found.folder is None or not found.meta.get("finished"):
            raise CloudMLError(
                f"{self} is not trained to its end yet: run the same train command to resume it"
            )
        return found

    # -------------------------------------------------------------------------- state

    def holds_run(self) -> bool:
        """It holds a run's files (checkpoints, metrics, config), CloudML's or not."""
        return runfolder.has_run(self)

    def is_crossval(self) -> bool:
        return runfolder.is_crossval(self)

    def state(self, check_lock: bool = True) -> status.RunState:
        """Where the run stands, in the run states' words (stopped, trained, finished, failed, ...)."""
        return status.run_state(self, check_lock)

    def is_finished(self) -> bool:
        """Trained and evaluated (the state "finished"); an unreadable run is not."""
        return status.is_finished(self)

    def status(self) -> dict:
        """Where the run stands in detail (its position, best score, lock holder, compile, damage)."""
        return status.run_status(self)

    # -------------------------------------------------------------------------- its files

    @property
    def files(self) -> RunFiles:
        """The readers of its files, each file checked for type and range (base/runfiles.py)."""
        return RunFiles(self.path)

    def write_run_info(self, info: dict) -> None:
        """run.json, through its one writer."""
        runfolder.write_run_info(self, info)

    def record_failure(self, why: str) -> None:
        """run.json says the last command on this run stopped on an error (the state "failed")."""
        runfolder.record_failure(self, why)

    def metrics_file(self, dist: Dist) -> runfolder.MetricsFile:
        """metrics.jsonl, appended to by the main process only."""
        return runfolder.MetricsFile(self, dist)
