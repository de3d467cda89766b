"""A run directory over time: what an interrupted run left behind, where a run resumes from and what
a resumed run may change, where it stands (status). Who may write into it is runlock.py's; its log
(train.log) is logs.py's.

When a resumed run's config differs from the checkpoint's, settings that change the run's math
(data, model, seed, batch size, optimizer and schedule settings) are an error naming each one;
harmless ones (epochs, patience, devices, compile, logging and checkpoint cadence, paths) are taken
from the new config with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cloudml_lib.base import ledger
from cloudml_lib.base.config import NEW, absent_settings, derive, field_metadata, renamed_keys, resume_rules
from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.files import read_text, what_is
from cloudml_lib.base.liveness import holder_alive, process_alive
from cloudml_lib.base.outputs import (
    append_text,
    json_safe,
    open_append,
    refuse_link,
    refuse_special,
    write_text,
)
from cloudml_lib.base.ownership import MARKER, Kind, check, is_marked, marker_kind
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.base.shapes import TEXT, Damaged, Obj, parse_json
from cloudml_lib.core.checkpoint import (
    BEST_KEYS,
    META,
    REJECTED_DIR,
    STAGING,
    STAGING_PREFIX,
    STATE,
    Found,
    Key,
    check_folder,
    checkpoints_dir,
    find_checkpoints,
    find_latest_valid,
    load_checkpoint,
    set_aside_rejected,
    step_of,
    verify,
)
from cloudml_lib.core.compile import describe_saved
from cloudml_lib.core.progress import Progress
from cloudml_lib.core.runlock import LOCK, read_lock

if TYPE_CHECKING:
    from cloudml_lib.core.distributed import Dist

log = logging.getLogger(__name__)


def _pid_of(name: str) -> int | None:
    m = re.search(r"(?:tmp-|ckpt-)(\d+)", name)
    return int(m.group(1)) if m else None


def clean_leftovers(run_dir: Path) -> list[str]:
    """What a killed process left behind: temporary best.pt files, checkpoint folders half-written or
    half-deleted, and staging folders in the temp directory. Only files of processes that are gone."""
    run_dir, removed = Path(run_dir), []
    candidates = list(run_dir.glob(".best.pt.tmp-*")) + list(run_dir.glob(".lock.tmp-*"))
    candidates += list(checkpoints_dir(run_dir).glob(".step-*.tmp-*"))
    candidates += list(checkpoints_dir(run_dir).glob(".trash-*"))
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


def compare_configs(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(math-changing differences, harmless differences), each as 'key (checkpoint X, now Y)', by each field's
    resume rule (config.py). The saved config is read by today's rules first: a setting added since it was
    saved counts as what that version did (its default, or its field's `absent` meaning), a value an earlier
    version wrote as what it means now."""
    rules, fields = resume_rules(), field_metadata()
    a, b = flatten_keys(renamed_keys(saved)), flatten_keys(current)
    for key, meta in fields.items():
        if key not in a and key in b:
            a[key] = meta["absent"]
        elif key in a and any(a[key] is old for old in meta.get("legacy") or {}):
            a[key] = meta["legacy"][a[key]]
    math, harmless = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key} (checkpoint {shown(a.get(key))}, now {shown(b.get(key))})"
            (harmless if rules.get(key) == NEW else math).append(line)
    return math, harmless


# The files a run writes at the top of its folder, each refused where it is a link or not a regular file.
RUN_WRITES = (
    "config.yaml",
    "run.json",
    "provenance.json",
    "metrics.jsonl",
    "train.log",
    "best.pt",
    "evaluation.json",
    "predictions.csv",
    "intervals.json",
    "report.md",
    "crossval.json",
    "crossval.md",
    "sweep.json",
    "study.journal",
    "trial.json",
)


def check_run_writes(run_dir: Path) -> None:
    """Each file a run writes at the top of its folder is a regular file or nothing yet: not a symbolic link
    (outputs.refuse_link), not a FIFO, a socket, a device or a folder (outputs.refuse_special)."""
    for name in RUN_WRITES:
        refuse_link(Path(run_dir) / name)
        refuse_special(Path(run_dir) / name)


RUN_NAMES = ("metrics.jsonl", "best.pt", "checkpoints", "config.yaml")


def has_run(run_dir: Path) -> bool:
    """Whether a folder holds a run's names (whose run it is: is_cloudml_run)."""
    return bool(run_names(run_dir))


def run_names(run_dir: Path) -> list[str]:
    return [n for n in RUN_NAMES if (Path(run_dir) / n).exists()]


def is_cloudml_run(run_dir: Path) -> bool:
    """A run folder CloudML can prove its own: its marker, written for it, or an earlier release's content
    that verifies (adopt_run). Another tool's `checkpoints/` is no run of CloudML's."""
    try:
        if marker_kind(Path(run_dir)) == RUN.name:
            return True
    except CloudMLError:
        return False  # a damaged marker: not told to be CloudML's
    return adopt_run(Path(run_dir)) is not None


def is_crossval(run_dir: Path) -> bool:
    run_dir = Path(run_dir)
    return (
        (run_dir / "folds").is_dir()
        or (run_dir / "crossval.json").is_file()
        or is_marked(run_dir, "cross-validation")
    )


def fold_models(run_dir: Path) -> list[Path]:
    return sorted(p / "model" for p in (Path(run_dir) / "folds").glob("*") if (p / "model").is_dir())


def check_folder_kind(run_dir: Path, command: str) -> None:
    """Each command on the kind of folder it works on: `train` and `evaluate` on a run, `crossval` on a
    cross-validation folder. The wrong kind is named, with the command that fits it. `train` and `crossval`
    also refuse a folder that is not CloudML's (base/ownership.py) and a link where a run writes a file
    (`evaluate` too where it writes: science/evaluate.py)."""
    run_dir = Path(run_dir)
    marked = marker_kind(run_dir) if run_dir.is_dir() else None
    if (run_dir / "sweep.json").is_file() or marked == SWEEP.name:
        trials = sorted(p.name for p in (run_dir / "trials").glob("*") if p.name.isdigit())
        raise CloudMLError(
            f"{run_dir} is a sweep folder: its report is {run_dir / 'report.md'} and each trial is a "
            f"run of its own, e.g. --run-dir {run_dir / 'trials' / (trials[0] if trials else '0')}; "
            "to continue the sweep: python -m cloudml_lib sweep ... with the same --run-dir. "
            "Nothing was changed."
        )
    if command == "crossval":
        check_run_writes(run_dir)  # a link where a run writes is named first: the most exact refusal
        check(run_dir, CROSSVAL)  # a folder of its own, before anything is written (ownership.py)
        if has_run(run_dir) and not is_crossval(run_dir):
            raise CloudMLError(
                f"{run_dir} holds a training run (checkpoints, metrics), not a cross-validation; "
                "choose another --run-dir for the cross-validation. Nothing was changed."
            )
        return
    if not is_crossval(run_dir):
        if command == "train":
            check_run_writes(run_dir)
            check(run_dir, RUN)
        return
    folds = fold_models(run_dir)
    example = folds[0] if folds else run_dir / "folds" / "<flight>" / "model"
    if command == "train":
        raise CloudMLError(
            f"{run_dir} is a cross-validation folder (it holds folds/): train would write a separate "
            f"run beside its folds. To continue the cross-validation: python -m cloudml_lib crossval "
            f"--config FILE --run-dir {run_dir}; to train one model, choose another --run-dir. "
            "Nothing was changed."
        )
    raise CloudMLError(
        f"{run_dir} is a cross-validation folder: its results are in {run_dir / 'crossval.md'}. Each "
        f"fold's model is a run of its own, e.g. python -m cloudml_lib {command} --run-dir {example}"
        + (f" (folds: {', '.join(f.parent.name for f in folds)})" if folds else "")
    )


# ------------------------------------------------------------------------- resuming


def find_resume_point(run_dir: Path, mode: str) -> Found | None:
    """The checkpoint a run continues from (None: start afresh), by --resume auto|never|PATH."""
    if mode == "never":
        if has_run(run_dir):
            raise CloudMLError(
                f"{run_dir} already holds a run and --resume never refuses to touch it; "
                "choose another --run-dir, or use --resume auto to continue it"
            )
        return None
    if mode == "auto":
        return _newest_resume_point(run_dir)
    folder = Path(mode)
    if folder.is_file() and folder.name != "state.pt":
        raise CloudMLError(
            f"--resume {mode}: give a checkpoint folder (RUN_DIR/checkpoints/step-N) or its state.pt. "
            + (
                "best.pt holds the best model's weights only, not a resumable state (no optimizer, "
                "schedule or position). "
                if folder.name == "best.pt"
                else ""
            )
            + "--resume auto continues from the newest valid checkpoint."
        )
    folder = folder.parent if folder.is_file() else folder
    if not folder.is_dir():
        raise CloudMLError(f"--resume {mode}: no such checkpoint folder")
    if not (folder / META).is_file() and not (folder / STATE).is_file():
        raise CloudMLError(
            f"--resume {mode}: not a checkpoint folder (no {STATE}, no {META}); checkpoints are "
            "RUN_DIR/checkpoints/step-N"
        )
    reason, state, meta = check_folder(folder)
    if reason:
        raise CloudMLError(f"--resume {mode}: {reason}")
    _check_same_run(run_dir, folder, state)
    folder = _name_by_content(run_dir, folder, state)
    if folder.parent.resolve() == checkpoints_dir(run_dir).resolve():
        _set_aside_newer(run_dir, int(Progress.of(state).step))
    return Found(folder, state, [], meta)


def _newest_resume_point(run_dir: Path) -> Found | None:
    """--resume auto: the newest checkpoint that verifies. One whose folder name says another step than its
    content is renamed by its content (_name_by_content) and the checkpoints are walked again: the run
    resumes at the step inside it, and that name is never again taken for the newest checkpoint."""
    if not find_checkpoints(run_dir):
        if has_run(run_dir):
            log.info("%s has no checkpoint yet: starting this run from the beginning", run_dir)
        return None
    while True:  # each pass renames a misnamed folder or returns: at most one pass per checkpoint, plus one
        found = find_latest_valid(run_dir)
        for r in found.rejected:
            log.warning("Rejected checkpoint %s: %s", r["path"], r["reason"])
        if found.folder is None:
            break
        set_aside_rejected(run_dir, found.rejected)  # never met again: the run re-commits those steps
        if _name_by_content(run_dir, found.folder, found.state) == found.folder:
            return found
    if not any(r["committed"] for r in found.rejected):
        set_aside_rejected(run_dir, found.rejected)  # only interrupted first writes: nothing to keep
        log.info(
            "%s has no committed checkpoint yet (the first write was interrupted): starting this run "
            "from the beginning",
            run_dir,
        )
        return None
    raise CloudMLError(
        f"none of the {len(found.rejected)} checkpoints in {run_dir / 'checkpoints'} can be used "
        f"(newest: {found.rejected[0]['reason']}). Nothing was changed. Start a new run with "
        f"--run-dir NEW, or delete {run_dir / 'checkpoints'} to start this one over."
    )


def _name_by_content(run_dir: Path, folder: Path, state: dict) -> Path:
    """A checkpoint is trusted by its content (the step in its verified state.pt), not by its folder's name.
    A name that says another step (renamed or copied by hand) is warned about, naming the folder; inside this
    run's checkpoints/ the folder then takes its content's name, or moves to rejected/ where a checkpoint
    holds that name already, so that it is neither resumed from again at every start nor kept from pruning.
    Returns where the folder is now."""
    step = int(Progress.of(state).step)
    if step_of(folder) == step:
        return folder
    ours = folder.parent.resolve() == checkpoints_dir(run_dir).resolve()
    right = folder.with_name(f"step-{step:08d}")
    taken = ours and os.path.lexists(right)
    moved = (
        right
        if not taken
        else Path(run_dir) / REJECTED_DIR / f"{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    log.warning(
        "Checkpoint folder %s holds step %d (its verified state.pt says so), not the step its name says: "
        "the run resumes from step %d%s",
        folder,
        step,
        step,
        f", and the folder is moved to {moved}" if ours else "",
    )
    if not ours:
        return folder
    moved.parent.mkdir(exist_ok=True)
    os.replace(folder, moved)
    return moved


def _check_same_run(run_dir: Path, folder: Path, state: dict) -> None:
    """--resume PATH continues this run: a checkpoint from inside the run folder (checkpoints/, rejected/,
    superseded-*/), or one that carries this run's id (a copy of the whole run). Another run's checkpoint
    goes only into an empty folder, which then becomes a copy of that run from that step."""
    run_dir = Path(run_dir)
    if run_dir.resolve() in folder.resolve().parents:
        return
    theirs = Progress.of(state).run_id or None
    newest = find_latest_valid(run_dir, load=False)
    ours = newest.meta.get("run_id") if newest.meta else None
    if theirs is not None and theirs == ours:
        return
    if has_run(run_dir):
        raise CloudMLError(
            f"--resume {folder}: that checkpoint belongs to another run than the one in {run_dir}. "
            f"To continue that run, use --run-dir with its own folder ({folder.parent.parent}); to "
            f"continue this one, use --resume auto. Nothing was changed."
        )
    log.warning(
        "Continuing in %s from %s, a checkpoint of another run folder: this folder becomes a copy of that "
        "run from step %d",
        run_dir,
        folder,
        Progress.of(state).step,
    )


def _set_aside_newer(run_dir: Path, step: int) -> None:
    newer = [p for p in find_checkpoints(run_dir) if step_of(p) > step]
    newer = [p for p in newer if ledger.skip_unless_mine(p, "move aside")]  # another tool's step-* stays
    if newer:
        aside = run_dir / f"{SUPERSEDED}{time.strftime('%Y%m%d-%H%M%S')}"
        ledger.add(aside)
        aside.mkdir()
        for p in newer:
            p.rename(aside / p.name)
            ledger.drop(p)
        log.warning("Moved %d checkpoints newer than step %d to %s", len(newer), step, aside)


def resumed_config(cfg, saved: dict):
    """The config a resumed run goes on with: `cfg`, with a batch size of "auto" as the run measured it when
    it started, and a setting added since the checkpoint was saved as that version computed it
    (absent_settings: an old run keeps its model.height_head). `cfg` itself is not changed."""
    changes = absent_settings(saved)
    if cfg.train.batch_size == "auto":  # measured once, when the run started
        changes["train.batch_size"] = saved["train"]["batch_size"]
    return derive(cfg, changes) if changes else cfg


def check_resume_config(cfg, saved: dict) -> None:
    """Refuse math-changing differences from the checkpoint's config; take harmless ones with a warning."""
    cfg = resumed_config(cfg, saved)
    math_changes, harmless = compare_configs(saved, cfg.to_dict())
    if math_changes:
        raise CloudMLError(
            "the config differs from the checkpoint's in settings that change the run's math:\n  - "
            + "\n  - ".join(math_changes)
            + "\nResume with the checkpoint's values (see config.yaml in the run directory), or start a new "
            "run with --run-dir NEW. Nothing was changed."
        )
    for key, value in absent_settings(saved).items():
        log.info("This run was saved before %s existed: it continues with %s, as it was trained", key, value)
    if harmless:
        log.warning("Resuming with changed settings (taken from the new config): %s", "; ".join(harmless))
        if any(h.startswith("train.epochs ") for h in harmless):
            log.warning(
                "train.epochs changed: the cosine learning-rate decay is re-planned over the new length"
            )


def recorded_files(run_dir: Path) -> dict[str, dict]:
    """Flight -> {role: SHA-256} of the files the run in `run_dir` started from (its provenance.json)."""
    from cloudml_lib.core.provenance import read_run_provenance

    flights = (read_run_provenance(run_dir) or {}).get("flights") or {}
    out = {}
    for name, info in flights.items() if isinstance(flights, dict) else []:
        files = info.get("files") if isinstance(info, dict) else None
        if isinstance(files, dict):
            out[name] = {r: f.get("sha256") for r, f in files.items() if isinstance(f, dict)}
    return out


def _same_files(name: str, saved: dict, current: dict, recorded: dict) -> bool:
    """Whether flight `name`'s files are the ones the run started from, by their SHA-256 (the checkpoint's
    record, else the run's provenance.json); False where that cannot be told."""
    before = saved.get("files") or recorded.get(name)
    now = current.get("files")
    return bool(before) and bool(now) and all(before.get(r) and before.get(r) == now.get(r) for r in now)


def check_data_fingerprint(saved: dict | None, current: dict, recorded: dict | None = None) -> None:
    """Refuse to continue a run on data whose content changed (flights, samples, labels, frames). Where a
    flight's files are the very ones the run started from (`recorded`: flight -> {role: SHA-256}, from the
    run's provenance.json), the reader changed, not the data: said so, with the advice that can help."""
    if saved is None:
        log.info("This checkpoint predates data fingerprints: the data is not compared")
        return
    recorded = recorded or {}
    changes = [f"flight {n}: gone" for n in saved if n not in current]
    changes += [f"flight {n}: new" for n in current if n not in saved]
    reread = []
    for n in sorted(set(saved) & set(current)):
        a, b = saved[n], current[n]
        if a["samples"] == b["samples"] and a["sha256"] == b["sha256"]:
            continue
        what = (
            f"{a['samples']} samples in the checkpoint, {b['samples']} now"
            if a["samples"] != b["samples"]
            else "same number of samples, different content (labels, angles or frames)"
        )
        if _same_files(n, a, b, recorded):
            reread.append(n)
            what += "; its files are unchanged (the same SHA-256 as when the run started)"
        changes.append(f"flight {n}: {what}")
    if changes and reread and len(reread) == len(changes):
        raise CloudMLError(
            "this run cannot continue on this version of CloudML:\n  - "
            + "\n  - ".join(changes)
            + "\nThe files are the original ones: what changed is how CloudML reads them (a reader was "
            "corrected since the run was saved, e.g. fill values in an ICARTT nav file are no longer taken "
            "as angles). Continuing would train one model on two readings of the same flights. The run's "
            "checkpoints and best.pt stay usable (evaluate, predict); use another --run-dir for a new run "
            "on today's reading. Nothing was changed."
        )
    if changes:
        raise CloudMLError(
            "the data differs from the data this run was trained on:\n  - "
            + "\n  - ".join(changes)
            + "\nContinuing would mix two datasets in one run. Resume with the original data "
            "(files, data.* filters), or start a new run with --run-dir NEW. Nothing was changed."
        )


def truncate_metrics(path: Path, size: int) -> None:
    """metrics.jsonl (`path`) continues exactly where the checkpoint left it: later lines are work to redo."""
    with open_append(path) as f:  # never through a symbolic link: an outside file is not cut
        if os.fstat(f.fileno()).st_size > size:
            os.ftruncate(f.fileno(), size)
        elif size and os.fstat(f.fileno()).st_size < size:
            log.warning(
                "metrics.jsonl is shorter than when the checkpoint was saved; earlier records are lost"
            )


def is_finished(run_dir: Path | None) -> bool:
    """A run that is trained and evaluated (run_state "finished"); an unreadable one is not."""
    try:
        return run_dir is not None and run_state(run_dir).kind == "finished"
    except Exception:  # noqa: BLE001 - an unreadable run is simply not finished
        return False


def run_status(run_dir: str | Path) -> dict:
    """Where a run stands, from its newest valid checkpoint's manifest and its metrics."""
    run_dir = Path(run_dir)
    if is_crossval(run_dir):
        folds = {m.parent.name: run_status(m) if has_run(m) else None for m in fold_models(run_dir)}
        return {
            "run_dir": str(run_dir),
            "crossval": True,
            "folds": folds,
            "finished": (run_dir / "crossval.json").is_file(),
        }
    if not has_run(run_dir):
        raise CloudMLError(f"{run_dir} holds no run (no checkpoints, metrics.jsonl or config.yaml)")
    if not is_cloudml_run(run_dir):
        raise CloudMLError(
            f"{run_dir} holds a run's names ({', '.join(run_names(run_dir))}) but is not a CloudML run: no "
            f"{MARKER} marker written for it, and no checkpoint or best.pt of CloudML's that verifies. "
            "Another tool's folder? Nothing was read further or changed."
        )
    found = find_latest_valid(run_dir)  # the same verification as resume
    status = {
        "run_dir": str(run_dir),
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
        "checkpoints": len(find_checkpoints(run_dir)),
        "locked_by": None,
        "compile": None,
        "damaged": [],
    }
    files = RunFiles(run_dir)
    status["compile"] = files.run_info().get("compile")
    status["damaged"] = files.damaged
    if found.folder is not None:
        status.update(_position(found))
    status["locked_by"] = _lock_holder(run_dir)
    state = run_state(run_dir)
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


def _lock_holder(run_dir: Path) -> str | None:
    """host:pid of a live process holding the run's lock, or None."""
    lock = Path(run_dir) / LOCK
    if not os.path.lexists(lock):
        return None
    try:
        info = read_lock(lock)
    except CloudMLError:  # not a file (a FIFO): no process holds the run by it
        return None
    return f"{info.get('host')}:{info.get('pid')}" if info and holder_alive(info) else None


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
        lines.append(f"best validation loss {s['best_metric']:.4f}{r2}")
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


class MetricsFile:
    """RUN_DIR/metrics.jsonl: one JSON object a line (step records, epoch records, the final record); the
    notebook's curves, `compare` and the plots read it back. Only rank 0 writes."""

    def __init__(self, run_dir: Path, dist: Dist):
        self.path, self.dist = Path(run_dir) / "metrics.jsonl", dist

    def append(self, record: dict) -> None:
        if self.dist.is_main:
            append_text(self.path, json.dumps(json_safe(record)) + "\n")

    def size(self) -> int:
        return self.path.stat().st_size


# ------------------------------------------------------------------------------ run states
@dataclass(frozen=True)
class RunState:
    """Where a run stands, one definition for `status`, `compare`, the picker and the Train cell.

    kind: "none" (no run here), "running" (a live process holds it), "stopped" (resumable), "trained" (its
    end is pending: `why`), "finished" (trained, and its evaluation is valid), "failed" (`why`: the last
    command stopped on an error; run again once that is fixed, it resumes)."""

    kind: str
    why: str = ""

    @property
    def words(self) -> str:
        return {
            "none": "not a run",
            "running": "running",
            "stopped": "stopped (resumable)",
            "trained": f"trained, end pending ({self.why})",
            "finished": "finished",
            "failed": f"failed ({self.why})",
        }[self.kind]


def run_state(run_dir: str | Path, check_lock: bool = True) -> RunState:
    """The state of the run in `run_dir` (a cross-validation's folds each have their own). `check_lock`:
    a live lock holder makes it "running" (off for the process about to take the lock itself)."""
    run_dir = Path(run_dir)
    if not has_run(run_dir) or not is_cloudml_run(run_dir):
        return RunState("none")
    if check_lock and _lock_holder(run_dir):
        return RunState("running")
    found = find_latest_valid(run_dir, load=False)
    failed = RunFiles(run_dir).run_info().get("failed")
    meta = found.meta if found.folder is not None else {}
    if not meta.get("finished"):
        return RunState("failed", str(failed)) if failed else RunState("stopped")
    files = RunFiles(run_dir)
    evaluation = files.evaluation()
    if files.damaged and (run_dir / "evaluation.json").exists():
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
    return RunState("finished")


def trained_checkpoint(run_dir: Path) -> Found:
    """The newest valid checkpoint of a trained run, loaded (the end of a run starts from it)."""
    found = find_latest_valid(Path(run_dir))
    if found.folder is None or not found.meta.get("finished"):
        raise CloudMLError(
            f"{run_dir} is not trained to its end yet: run the same train command to resume it"
        )
    return found


def record_failure(run_dir: Path, why: str) -> None:
    """run.json says the last command on this run stopped on an error (run_state's "failed"); the next start
    rewrites run.json without it."""
    if not is_marked(run_dir, RUN.name):
        return  # not (yet) this run's folder: a refused folder is left as it was
    if what_is(Path(run_dir) / "run.json") or (Path(run_dir) / "run.json").is_symlink():
        return  # the refusal named it: what stands there is left as it is
    info = RunFiles(Path(run_dir)).run_info()
    if info or (Path(run_dir) / "checkpoints").is_dir():
        write_text(
            Path(run_dir) / "run.json", json.dumps(json_safe(dict(info, failed=shown(why, 300))), indent=1)
        )


# ------------------------------------------------------------------------------ whose folder it is
def adopt_run(folder: Path) -> str | None:
    """An earlier release's run folder, proved by its content, never by one file (a best.pt copied into a
    user's folder proved it theirs): its newest committed checkpoint that verifies (the recorded checksum
    matches, it loads weights-only with the keys a resume needs) and holds the config of the folder's
    config.yaml; or a best.pt that loads weights-only with the keys of a best model beside a config.yaml that
    says what its stored config says."""
    folder = Path(folder)
    for ckpt in find_checkpoints(folder):
        reason, state, _ = check_folder(ckpt, load=True)
        if reason is None and _same_config(folder / "config.yaml", state.get(Key.CONFIG)):
            return f"its checkpoint {ckpt.name} verifies"
    best = folder / "best.pt"
    if best.is_file() and not best.is_symlink():
        try:
            ckpt = load_checkpoint(best)
        except CloudMLError:
            return None
        if (
            isinstance(ckpt, dict)
            and all(k in ckpt for k in BEST_KEYS)
            and os.path.lexists(folder / "config.yaml")
            and _same_config(folder / "config.yaml", ckpt[Key.CONFIG])
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
    fold = next((m for m in fold_models(Path(folder)) if adopt_run(m)), None)
    return f"its fold {fold.parent.name} is a run that verifies" if fold else None


def adopt_sweep(folder: Path) -> str | None:
    """An earlier release's sweep: a readable sweep.json beside a journal naming its study, or a trial that is
    a run."""
    folder = Path(folder)
    if RunFiles(folder).sweep() and _journal_names_a_study(folder / "study.journal"):
        return "its sweep.json reads and its study.journal names the study"
    trials = sorted((p for p in (folder / "trials").glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
    trial = next((t for t in trials if adopt_run(t)), None)
    return f"its trial {trial.name} is a run that verifies" if trial else None


def _journal_names_a_study(path: Path) -> bool:
    try:
        first = read_text(path, limit=1 << 20, follow=False).split("\n", 1)[0] if path.is_file() else ""
        parse_json(first, Obj({"study_name": TEXT}, required=("study_name",)))
        return True
    except (OSError, Damaged, CloudMLError):
        return False


SUPERSEDED = "superseded-"  # + a time: the checkpoints newer than the one a resume was told to start from
# The folders a run makes at its top level besides checkpoints/ (whose checkpoints are proved one by one).
RUN_FOLDERS = ("plots", REJECTED_DIR)


def owned_by_run(folder: Path) -> list[str]:
    """What of a run folder claimed before ledgers is the run's own (base/ledger.py): the files and folders
    it writes by name (RUN_WRITES, RUN_FOLDERS, superseded-*), and each checkpoint whose checksum matches.
    Its tensorboard/ is not among them: event files prove no owner (another tool writes the same names); a
    fresh start leaves them, named once."""
    folder = Path(folder)
    here = [folder / n for n in RUN_WRITES + RUN_FOLDERS]
    names = [p.name for p in here if os.path.lexists(p) and not p.is_symlink()]
    ckpts = checkpoints_dir(folder).name
    names += [f"{ckpts}/{c.name}" for c in find_checkpoints(folder) if verify(c) is None]
    names += [p.name for p in folder.glob(f"{SUPERSEDED}*") if p.is_dir() and not p.is_symlink()]
    return names


RUN = Kind("run", "--run-dir", adopt_run, "an existing run folder to continue that run", owned_by_run)
CROSSVAL = Kind(
    "cross-validation", "--run-dir", adopt_crossval, "an existing cross-validation folder to continue it"
)
SWEEP = Kind("sweep", "--run-dir", adopt_sweep, "an existing sweep folder to continue that sweep")
KINDS = {"train": RUN, "evaluate": RUN, "predict": RUN, "crossval": CROSSVAL, "sweep": SWEEP}
