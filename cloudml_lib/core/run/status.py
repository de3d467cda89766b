"""Where a run stands: the one definition of its state (RunState: stopped (resumable), trained with its
end pending, finished, failed, running), what `status` prints of a run, and the trained checkpoint the run's
end starts from.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.ownership import MARKER
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.network.compile import describe_saved
from cloudml_lib.core.run.checkpoint import (
    Found,
    best_weights_sha256,
    find_checkpoints,
    find_latest_valid,
)
from cloudml_lib.core.run.runfolder import fold_models, has_run, is_cloudml_run, is_crossval, run_names
from cloudml_lib.core.run.runlock import lock_holder

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


def is_finished(run: RunLayout | None) -> bool:
    """A run that is trained and evaluated (run_state "finished"); an unreadable one is not."""
    try:
        return run is not None and run_state(run).kind == "finished"
    except Exception:  # noqa: BLE001 - an unreadable run is simply not finished
        return False


def run_status(run: RunLayout) -> dict:
    """Where a run stands, from its newest valid checkpoint's manifest and its metrics."""
    if is_crossval(run):
        folds = {
            m.parent.name: run_status(RunLayout(m)) if has_run(RunLayout(m)) else None
            for m in fold_models(run)
        }
        return {
            "run_dir": str(run),
            "crossval": True,
            "folds": folds,
            "finished": (run.path / "crossval.json").is_file(),
        }
    if not has_run(run):
        raise CloudMLError(f"{run} holds no run (no checkpoints, metrics.jsonl or config.yaml)")
    if not is_cloudml_run(run):
        raise CloudMLError(
            f"{run} holds a run's names ({', '.join(run_names(run))}) but is not a CloudML run: no "
            f"{MARKER} marker written for it, and no checkpoint or best.pt of CloudML's that verifies. "
            "Another tool's folder? Nothing was read further or changed."
        )
    found = find_latest_valid(run)  # the same verification as resume
    status = {
        "run_dir": str(run),
        "epoch": 0,
        "epochs_completed": 0,
        "epochs": None,
        "step": 0,
        "total_steps": None,
        "batch": 0,
        "batches_per_epoch": None,
        "progress": 0.0,
        "best_metric": None,
        "best_r2": None,
        "latest_checkpoint": None,
        "latest_checkpoint_age_s": None,
        "finished": False,
        "rejected": found.rejected,
        "checkpoints": len(find_checkpoints(run)),
        "locked_by": None,
        "compile": None,
        "damaged": [],
    }
    files = RunFiles(run.path)
    status["compile"] = files.run_info().get("compile")
    status["damaged"] = files.damaged
    if found.folder is not None:
        status.update(_position(found))
    status["locked_by"] = lock_holder(run)
    state = run_state(run)
    status["trained"], status["finished"] = bool(status["finished"]), state.kind == "finished"
    status["state"], status["state_words"] = state.kind, state.words
    return status


MANIFEST_FIELDS = (
    "epochs",
    "step",
    "total_steps",
    "batch",
    "batches_per_epoch",
    "finished",
    "best_metric",
    "best_r2",
)


def _position(found: Found) -> dict:
    """Where the newest valid checkpoint says the run is. `epoch` is the epoch in progress (1-based), as in
    the resume banner; a finished run shows its last."""
    meta = found.meta
    out = {k: meta.get(k) for k in MANIFEST_FIELDS}
    out["epochs_completed"] = meta["epoch"]
    out["epoch"] = meta["epoch"] if meta["finished"] else min(meta["epoch"] + 1, meta["epochs"])
    out["progress"] = 100.0 * meta["step"] / meta["total_steps"] if meta.get("total_steps") else 0.0
    out["latest_checkpoint"] = str(found.folder / meta.get("file", "state.pt"))
    out["latest_checkpoint_age_s"] = max(0.0, time.time() - float(meta["saved_at"]))
    return out


def format_status(s: dict) -> str:
    if s.get("crossval"):
        done = sum(1 for f in s["folds"].values() if f and f["finished"])
        lines = [
            f"{s['run_dir']}: cross-validation, "
            + ("finished (crossval.md)" if s["finished"] else f"{done} of {len(s['folds'])} folds trained")
        ]
        for name, f in s["folds"].items():
            lines.append(
                f"  fold {name}: "
                + (format_status(f).splitlines()[0].split(": ", 1)[1] if f else "not started")
            )
        return "\n".join(lines)
    words = s.get("state_words") or ("finished" if s["finished"] else "stopped (resumable)")
    if s["latest_checkpoint"] is None:
        head = f"{words}: no valid checkpoint yet"
    elif s.get("trained", s["finished"]):
        head = (
            f"{words}: {s['epochs_completed']} of {s['epochs']} epochs, step {s['step']}/{s['total_steps']}"
        )
    else:
        head = (
            f"{words}: epoch {s['epoch']}/{s['epochs']} ({s['epochs_completed']} completed), batch "
            f"{s['batch']}/{s['batches_per_epoch']}, step {s['step']}/{s['total_steps']} "
            f"({s['progress']:.1f}%)"
        )
    lines = [f"{s['run_dir']}: {head}"]
    if s["best_metric"] is not None:
        r2 = f", R2 {s['best_r2']:.3f}" if s["best_r2"] is not None else ""
        lines.append(
            f"best epoch on the validation data (the score during training, not the test flights'): loss "
            f"{s['best_metric']:.4f}{r2}"
            + ("; the test flights' score: evaluation.json (evaluate)" if s["finished"] else "")
        )
    if s["latest_checkpoint"]:
        lines.append(
            f"latest checkpoint: {s['latest_checkpoint']} ({s['latest_checkpoint_age_s'] / 60:.1f} min ago)"
        )
    if s.get("compile") is not None:
        lines.append(f"torch.compile: {describe_saved(s['compile'])}")
    for r in s["rejected"]:
        lines.append(f"rejected: {r['path']}: {r['reason']}")
    lines += s.get("damaged", [])
    return "\n".join(lines)


@dataclass(frozen=True)
class RunState:
    """Where a run stands, one definition for `status`, `compare`, the picker and the Train cell.

    kind: "none" (no run here), "running" (a live process holds it), "stopped" (resumable), "trained" (its
    end is pending: `why`), "finished" (trained, and its evaluation is valid), "failed" (`why`: the last
    command stopped on an error; run again once that is fixed, it resumes). `advice`: what the user can do,
    kept apart from the reason (the end that a train command runs logs the reason alone)."""

    kind: str
    why: str = ""
    advice: str = ""

    @property
    def words(self) -> str:
        return {
            "none": "not a run",
            "running": "running",
            "stopped": "stopped (resumable)",
            "trained": f"trained, end pending ({self.why}{'; ' + self.advice if self.advice else ''})",
            "finished": "finished",
            "failed": f"failed ({self.why})",
        }[self.kind]


def run_state(run: RunLayout, check_lock: bool = True) -> RunState:
    """The state of the run in `run` (a cross-validation's folds each have their own). `check_lock`:
    a live lock holder makes it "running" (off for the process about to take the lock itself)."""
    if not has_run(run) or not is_cloudml_run(run):
        return RunState("none")
    if check_lock and lock_holder(run):
        return RunState("running")
    found = find_latest_valid(run, load=False)
    failed = RunFiles(run.path).run_info().get("failed")
    meta = found.meta if found.folder is not None else {}
    if not meta.get("finished"):
        return RunState("failed", str(failed)) if failed else RunState("stopped")
    files = RunFiles(run.path)
    evaluation = files.evaluation()
    if files.damaged and (run.evaluation).exists():
        return RunState("trained", files.damaged[0])
    if not evaluation:
        return RunState("failed", str(failed)) if failed else RunState("trained", "not evaluated yet")
    if meta.get("reason") == "final" and "step" not in evaluation:
        return RunState("finished")  # an earlier release's end: evaluated before its final checkpoint
    if evaluation.get("step") != meta.get("step"):
        return RunState(
            "trained",
            f"evaluation.json scored the weights of step {evaluation.get('step')}, not step {meta['step']}",
        )
    scored = evaluation.get("weights_sha256")  # an earlier release's evaluation has none: its step alone
    if isinstance(scored, str):
        held = best_weights_sha256(run.best)
        if held is None:
            return RunState(
                "trained",
                "best.pt is missing or cannot be read since the evaluation",
                "put it back, or run the same train command (its end writes best.pt again with the final "
                "checkpoint's weights, and scores them)",
            )
        if held != scored:
            return RunState(
                "trained",
                "evaluation.json scored other weights than best.pt holds now: best.pt was replaced or put "
                "back after the evaluation",
                "evaluate the run again, or run the same train command (its end scores them)",
            )
    return RunState("finished")
