"""A run folder: the names a run writes in it (base/layout.py), its kinds (a run, a cross-validation) and how
an earlier release's folder of each kind is proved and adopted (base/ownership.py; base/ledger.py for what of
it is CloudML's; a sweep's Kind, with its journal's format, is commands/sweep.py's), which command works on
which kind, what an interrupted run left behind, metrics.jsonl, and a failure's record. Who may write into
it is runlock.py's; where a run resumes is resume.py's; where it stands, status.py's; its log (train.log),
logs.py's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from cloudml_lib.base import ledger
from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.files import what_is
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.base.liveness import process_alive
from cloudml_lib.base.outputs import (
    append_text,
    json_safe,
    open_append,
    refuse_link,
    refuse_special,
    write_text,
)
from cloudml_lib.base.ownership import Kind, check, is_marked, kind_named, marker_kind, proves
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.run.checkpoint import (
    BEST_KEYS,
    STAGING,
    STAGING_PREFIX,
    Key,
    check_folder,
    find_checkpoints,
    load_checkpoint,
    verify,
)
from cloudml_lib.core.run.events import FINAL_EVENTS

if TYPE_CHECKING:
    from cloudml_lib.core.machine.distributed import Dist

log = logging.getLogger(__name__)


def _pid_of(name: str) -> int | None:
    m = re.search(r"(?:tmp-|ckpt-)(\d+)", name)
    return int(m.group(1)) if m else None


def clean_leftovers(run: RunLayout) -> list[str]:
    """What a killed process left behind: temporary best.pt files, checkpoint folders half-written or
    half-deleted, and staging folders in the temp directory. Only files of processes that are gone."""
    removed: list[str] = []
    candidates = list(run.path.glob(".best.pt.tmp-*")) + list(run.path.glob(".lock.tmp-*"))
    candidates += list(run.checkpoints.glob(".step-*.tmp-*"))
    candidates += list(run.checkpoints.glob(".trash-*"))
    staging = Path(tempfile.gettempdir()).glob(
        f"{STAGING_PREFIX}*"
    )  # in a shared folder: ours by marker only
    candidates += [p for p in staging if is_marked(p, STAGING)]
    for p in candidates:
        pid = _pid_of(p.name)
        if p.name.startswith(".trash-") or (
            pid is not None and pid != os.getpid() and not process_alive(pid)
        ):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p.name)
    if removed:
        log.info(
            "Removed %d leftovers of an interrupted run: %s", len(removed), ", ".join(sorted(removed)[:5])
        )
    return removed


def flatten_keys(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# The files a run writes at the top of its folder, each refused where it is a link or not a regular file.
RUN_WRITES = (
    RunLayout.CONFIG,
    RunLayout.RUN_INFO,
    RunLayout.PROVENANCE,
    RunLayout.METRICS,
    RunLayout.LOG,
    RunLayout.BEST,
    RunLayout.EVALUATION,
    RunLayout.PREDICTIONS,
    RunLayout.INTERVALS,
    RunLayout.REPORT,
    "crossval.json",
    "crossval.md",
    "sweep.json",
    "study.journal",
    RunLayout.TRIAL,
)


# What a run writes whole, by name, at its start and at its end: where one stands that the folder's ledger
# does not list, the write would be refused when it comes (after the training, for the end's files), so they
# are all named at once before anything starts (check_takes_run).
WHOLE_WRITES = (
    RunLayout.CONFIG,
    RunLayout.RUN_INFO,
    RunLayout.PROVENANCE,
    RunLayout.BEST,
    RunLayout.EVALUATION,
    RunLayout.PREDICTIONS,
    RunLayout.INTERVALS,
    RunLayout.REPORT,
    f"{RunLayout.PLOTS}/curves.png",
    f"{RunLayout.PLOTS}/scatter.png",
    f"{RunLayout.TENSORBOARD}/{FINAL_EVENTS}",
)


def check_takes_run(run: RunLayout) -> None:
    """Before a run writes anything in its folder: each file it writes at the top of the folder is a regular
    file or nothing yet (not a symbolic link, outputs.refuse_link; not a FIFO, a socket, a device or a folder,
    outputs.refuse_special); the folder is CloudML's run folder, new or empty (base/ownership.py); and no file
    the run writes whole (WHOLE_WRITES) stands there unlisted by the folder's ledger: another tool's or the
    user's, or a later state's of the run that a restore from a backup (`cp -a backup/. run/`, which puts the
    backup's ledger back) left beside it. Those are all named at once: each would stop the command when its
    write came, one at a time, the end's after the whole training."""
    for name in RUN_WRITES:
        refuse_link(run.path / name)
        refuse_special(run.path / name)
    check(run.path, RUN)
    theirs = [name for name in WHOLE_WRITES if ledger.unlisted(run.path / name)]
    if theirs:
        raise CloudMLError(
            f"{run}: {', '.join(theirs)} {'is' if len(theirs) == 1 else 'are'} not listed in the folder's "
            f"record of what CloudML wrote ({ledger.LEDGER}), so CloudML would not replace "
            f"{'it' if len(theirs) == 1 else 'them'} when the run writes its own. Yours, or another tool's, "
            "or files of a later state of this run that a restore from a backup left beside the backup's "
            "record? Move them out of the folder (e.g. into a folder beside the run), then run the same "
            "command again. Nothing was changed."
        )


def check_run_writes(run: RunLayout) -> None:
    """Each file a run writes at the top of its folder is a regular file or nothing yet: not a symbolic link
    (outputs.refuse_link), not a FIFO, a socket, a device or a folder (outputs.refuse_special)."""
    for name in RUN_WRITES:
        refuse_link(run.path / name)
        refuse_special(run.path / name)


RUN_NAMES = (RunLayout.METRICS, RunLayout.BEST, RunLayout.CHECKPOINTS, RunLayout.CONFIG)


def has_run(run: RunLayout) -> bool:
    """Whether a folder holds a run's names (whose run it is: is_cloudml_run)."""
    return bool(run_names(run))


def run_names(run: RunLayout) -> list[str]:
    return [n for n in RUN_NAMES if (run.path / n).exists()]


def is_cloudml_run(run: RunLayout) -> bool:
    """A run folder CloudML can prove its own (base/ownership.py: its marker, or an earlier release's content
    that verifies, adopt_run). Another tool's `checkpoints/` is no run of CloudML's."""
    return proves(run.path, RUN)


def is_crossval(run: RunLayout) -> bool:
    return _crossval_files(run) or is_marked(run.path, "cross-validation")


def _crossval_files(run: RunLayout) -> bool:
    return (run.path / "folds").is_dir() or (run.path / "crossval.json").is_file()


def fold_models(run: RunLayout) -> list[Path]:
    return sorted(p / "model" for p in (run.path / "folds").glob("*") if (p / "model").is_dir())


def _refuse_sweep(run: RunLayout, marked: str | None) -> None:
    """A sweep's folder (`marked`: the kind its marker names) is named as such, with the command line that
    continues it (its Kind's `continued_by`): no run or cross-validation is written in it."""
    if (run.path / "sweep.json").is_file() or marked == SWEEP_KIND:
        trials = sorted(p.name for p in (run.path / "trials").glob("*") if p.name.isdigit())
        sweep = kind_named(SWEEP_KIND)
        raise CloudMLError(
            f"{run} is a sweep folder: its report is {run.path / 'report.md'} and each trial is a "
            f"run of its own, e.g. --run-dir {run.path / 'trials' / (trials[0] if trials else '0')}; "
            f"to continue the sweep: python -m cloudml_lib {sweep.continued_by if sweep else 'sweep ...'} "
            "with the same --run-dir. Nothing was changed."
        )


def check_run_kind(run: RunLayout, trains: bool, command: str) -> None:
    """A command on a run's folder (train, evaluate, predict): a sweep's or a cross-validation's is named,
    with the command line that continues it. `trains`: the command trains in the folder, so a folder that is
    not CloudML's (base/ownership.py) and a link where a run writes a file are refused too (evaluate checks
    its own writes: science/evaluate.py). `command` is the caller's name, only for the example it gives; no
    rule here depends on it."""
    marked = marker_kind(run.path) if run.path.is_dir() else None  # a damaged marker is named here
    _refuse_sweep(run, marked)
    if not (marked == CROSSVAL.name or _crossval_files(run)):
        if trains:
            check_takes_run(run)
        return
    folds = fold_models(run)
    example = folds[0] if folds else run.path / "folds" / "<flight>" / "model"
    if trains:
        raise CloudMLError(
            f"{run} is a cross-validation folder (it holds folds/): {command} would write a separate "
            f"run beside its folds. To continue the cross-validation: python -m cloudml_lib "
            f"{CROSSVAL.continued_by} --run-dir {run}; to train one model, choose another --run-dir. "
            "Nothing was changed."
        )
    raise CloudMLError(
        f"{run} is a cross-validation folder: its results are in {run.path / 'crossval.md'}. Each "
        f"fold's model is a run of its own, e.g. python -m cloudml_lib {command} --run-dir {example}"
        + (f" (folds: {', '.join(f.parent.name for f in folds)})" if folds else "")
    )


def check_crossval_kind(run: RunLayout) -> None:
    """A cross-validation's folder: a sweep's or a training run's is named; a folder that is not CloudML's
    (base/ownership.py) and a link where a run writes a file are refused."""
    _refuse_sweep(run, marker_kind(run.path) if run.path.is_dir() else None)
    check_run_writes(run)  # a link where a run writes is named first: the most exact refusal
    check(run.path, CROSSVAL)  # a folder of its own, before anything is written (ownership.py)
    if has_run(run) and not is_crossval(run):
        raise CloudMLError(
            f"{run} holds a training run (checkpoints, metrics), not a cross-validation; "
            "choose another --run-dir for the cross-validation. Nothing was changed."
        )


def truncate_metrics(path: Path, size: int) -> None:
    """metrics.jsonl (`path`) continues exactly where the checkpoint left it: later lines are work to redo."""
    with open_append(path) as f:  # never through a symbolic link: an outside file is not cut
        if os.fstat(f.fileno()).st_size > size:
            ledger.truncating(path, size)  # its record first: a kill between the two leaves it CloudML's
            os.ftruncate(f.fileno(), size)
        elif size and os.fstat(f.fileno()).st_size < size:
            log.warning(
                "metrics.jsonl is shorter than when the checkpoint was saved; earlier records are lost"
            )


class MetricsFile:
    """RUN_DIR/metrics.jsonl: one JSON object a line (step records, epoch records, the final record); the
    notebook's curves, `compare` and the plots read it back. Only rank 0 writes."""

    def __init__(self, run: RunLayout, dist: Dist):
        self.path, self.dist = run.metrics, dist

    def append(self, record: dict) -> None:
        if self.dist.is_main:
            append_text(self.path, json.dumps(json_safe(record)) + "\n")

    def size(self) -> int:
        return self.path.stat().st_size


def write_run_info(run: RunLayout, info: dict) -> None:
    """run.json: the one writer (a start's plan and measurements, train/progress.py; a failure, below)."""
    write_text(run.run_info, json.dumps(json_safe(info), indent=1))


def record_failure(run: RunLayout, why: str) -> None:
    """run.json says the last command on this run stopped on an error (run_state's "failed"); the next start
    rewrites run.json without it."""
    if not is_marked(run.path, RUN.name):
        return  # not (yet) this run's folder: a refused folder is left as it was
    if what_is(run.run_info) or (run.run_info).is_symlink():
        return  # the refusal named it: what stands there is left as it is
    info = RunFiles(run.path).run_info()
    if info or (run.checkpoints).is_dir():
        write_run_info(run, dict(info, failed=shown(why, 300)))


def adopt_run(folder: Path) -> str | None:
    """An earlier release's run folder, proved by its content, never by one file (a best.pt copied into a
    user's folder proved it theirs): its newest committed checkpoint that verifies (the recorded checksum
    matches, it loads weights-only with the keys a resume needs) and holds the config of the folder's
    config.yaml; or a best.pt that loads weights-only with the keys of a best model beside a config.yaml that
    says what its stored config says."""
    folder = Path(folder)
    for ckpt in find_checkpoints(RunLayout(folder)):
        reason, state, _ = check_folder(ckpt, load=True)
        if reason is None and _same_config(RunLayout(folder).config, (state or {}).get(Key.CONFIG)):
            return f"its checkpoint {ckpt.name} verifies"
    best = RunLayout(folder).best
    if best.is_file() and not best.is_symlink():
        try:
            loaded = load_checkpoint(best)
        except CloudMLError:
            return None
        if (
            isinstance(loaded, dict)
            and all(k in loaded for k in BEST_KEYS)
            and os.path.lexists(RunLayout(folder).config)
            and _same_config(RunLayout(folder).config, loaded[Key.CONFIG])
        ):
            return "its best.pt loads with the keys of a best model, with the config of its config.yaml"
    return None


def _same_config(path: Path, saved) -> bool:
    """config.yaml (where the folder has one) says what the checkpoint's config says."""
    if not os.path.lexists(path):
        return True
    from cloudml_lib.base.yamlfile import read_yaml

    try:
        return isinstance(saved, dict) and flatten_keys(read_yaml(path)) == flatten_keys(saved)
    except CloudMLError:
        return False


def adopt_crossval(folder: Path) -> str | None:
    """An earlier release's cross-validation: a fold whose model is a run that verifies (a crossval.json
    alone, which can be copied, proves nothing)."""
    fold = next((m for m in fold_models(RunLayout(folder)) if adopt_run(m)), None)
    return f"its fold {fold.parent.name} is a run that verifies" if fold else None


SUPERSEDED = "superseded-"  # + a time: the checkpoints newer than the one a resume was told to start from


# The folders a run makes at its top level besides checkpoints/ (whose checkpoints are proved one by one).
RUN_FOLDERS = (RunLayout.PLOTS, RunLayout.REJECTED)


def owned_by_run(folder: Path) -> list[str]:
    """What of a run folder claimed before ledgers is the run's own (base/ledger.py): the files and folders
    it writes by name (RUN_WRITES, RUN_FOLDERS, superseded-*), each checkpoint whose checksum matches, and
    the end's TensorBoard file (events.FINAL_EVENTS). The other event files in tensorboard/ are not among
    them: they prove no owner (another tool writes the same names); a fresh start leaves them, named once."""
    folder = Path(folder)
    here = [folder / n for n in RUN_WRITES + RUN_FOLDERS]
    names = [p.name for p in here if os.path.lexists(p) and not p.is_symlink()]
    ckpts = RunLayout.CHECKPOINTS
    names += [f"{ckpts}/{c.name}" for c in find_checkpoints(RunLayout(folder)) if verify(c) is None]
    names += [p.name for p in folder.glob(f"{SUPERSEDED}*") if p.is_dir() and not p.is_symlink()]
    final = RunLayout(folder).tensorboard / FINAL_EVENTS  # a name no other tool writes: the end's values
    names += [f"{RunLayout.TENSORBOARD}/{FINAL_EVENTS}"] if final.is_file() and not final.is_symlink() else []
    return names


RUN = Kind(
    "run",
    "--run-dir",
    adopt_run,
    "an existing run folder to continue that run",
    owned_by_run,
    "train --config FILE",
)


CROSSVAL = Kind(
    "cross-validation",
    "--run-dir",
    adopt_crossval,
    "an existing cross-validation folder to continue it",
    continued_by="crossval --config FILE",
)


SWEEP_KIND = "sweep"  # the sweep's folder kind (its Kind, with the journal's format, is commands/sweep.py's)
