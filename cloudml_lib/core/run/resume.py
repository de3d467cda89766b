"""Where a run resumes from, and what a resumed run may change.

The resume point: the newest checkpoint that verifies, or the one `--resume PATH` names (from this run's
folder, or another run's into an empty folder); newer ones set aside. When a resumed run's config differs
from the checkpoint's, settings that change the run's math (data, model, seed, batch size, optimizer and
schedule settings) are an error naming each one; harmless ones (epochs, patience, devices, compile, logging
and checkpoint cadence, paths) are taken from the new config with a warning. The data must be the data the
run was trained on (its fingerprint and its recorded files).
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cloudml_lib.base import ledger
from cloudml_lib.base.config import NEW, absent_settings, derive, field_metadata, renamed_keys, resume_rules
from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.core.run.checkpoint import (
    META,
    REJECTED_DIR,
    STATE,
    Found,
    Key,
    check_folder,
    find_checkpoints,
    find_latest_valid,
    load_checkpoint,
    set_aside_rejected,
    step_of,
)
from cloudml_lib.core.run.progress import Progress
from cloudml_lib.core.run.runfolder import SUPERSEDED, flatten_keys, has_run

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


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
    math: list[str] = []
    harmless: list[str] = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key} (checkpoint {shown(a.get(key))}, now {shown(b.get(key))})"
            (harmless if rules.get(key) == NEW else math).append(line)
    return math, harmless


def find_resume_point(run: RunLayout, mode: str) -> Found | None:
    """The checkpoint a run continues from (None: start afresh), by --resume auto|never|PATH."""
    if mode == "never":
        if has_run(run):
            raise CloudMLError(
                f"{run} already holds a run and --resume never refuses to touch it; "
                "choose another --run-dir, or use --resume auto to continue it"
            )
        return None
    if mode == "auto":
        return _newest_resume_point(run)
    folder = Path(mode)
    if folder.is_file() and folder.name != "state.pt":
        raise CloudMLError(
            f"--resume {mode}: give a checkpoint folder (RUN_DIR/checkpoints/step-N) or its state.pt. "
            + (
                "best.pt holds the best model's weights only, not a resumable state (no optimizer, "
                "schedule or position). "
                if folder.name == RunLayout.BEST
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
    assert state is not None  # verified and loaded
    _check_same_run(run, folder, state)
    folder = _name_by_content(run, folder, state)
    _set_aside_later_evaluation(run, int(Progress.of(state).step))  # first: it may refuse
    if folder.parent.resolve() == run.checkpoints.resolve():
        _set_aside_newer(run, int(Progress.of(state).step))
    return Found(folder, state, [], meta or {})


def _newest_resume_point(run: RunLayout) -> Found | None:
    """--resume auto: the newest checkpoint that verifies. One whose folder name says another step than its
    content is renamed by its content (_name_by_content) and the checkpoints are walked again: the run
    resumes at the step inside it, and that name is never again taken for the newest checkpoint."""
    if not find_checkpoints(run):
        if has_run(run):
            log.info("%s has no checkpoint yet: starting this run from the beginning", run)
        return None
    while True:  # each pass renames a misnamed folder or returns: at most one pass per checkpoint, plus one
        found = find_latest_valid(run)
        for r in found.rejected:
            log.warning("Rejected checkpoint %s: %s", r["path"], r["reason"])
        if found.folder is None:
            break
        set_aside_rejected(run, found.rejected)  # never met again: the run re-commits those steps
        assert found.state is not None  # verified and loaded
        if _name_by_content(run, found.folder, found.state) == found.folder:
            found = _agreeing_with_best(run, found)
            assert found.state is not None
            _set_aside_later_evaluation(run, int(Progress.of(found.state).step))
            return found
    if not any(r["committed"] for r in found.rejected):
        set_aside_rejected(run, found.rejected)  # only interrupted first writes: nothing to keep
        log.info(
            "%s has no committed checkpoint yet (the first write was interrupted): starting this run "
            "from the beginning",
            run,
        )
        return None
    raise CloudMLError(
        f"none of the {len(found.rejected)} checkpoints in {run.path / 'checkpoints'} can be used "
        f"(newest: {found.rejected[0]['reason']}). Nothing was changed. Start a new run with "
        f"--run-dir NEW, or delete {run.path / 'checkpoints'} to start this one over."
    )


def _best_record(run: RunLayout, ckpt: dict | None = None) -> tuple[int, float, int | None] | None:
    """(epoch, validation loss, step) of the best model best.pt holds (`ckpt`: best.pt as the caller read
    it); None where that cannot be told (no best.pt, an unreadable one, one of an earlier release without
    them, or the newest weights the end wrote there, without a loss, where best.pt could not be used)."""
    if ckpt is None:
        if not run.best.is_file():
            return None
        try:
            ckpt = load_checkpoint(run.best)
        except (CloudMLError, OSError, RuntimeError, ValueError, EOFError):
            return None  # the end says so, and writes the newest weights there (science/finish.py)
    epoch, loss, step = ckpt.get(Key.EPOCH), ckpt.get(Key.VAL_LOSS), ckpt.get(Key.STEP)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not isinstance(loss, float):
        return None
    if not math.isfinite(loss):
        return None
    return epoch, loss, step if isinstance(step, int) and not isinstance(step, bool) else None


def _best_disagrees(best: tuple[int, float, int | None], state: dict) -> bool:
    """best.pt is not the best model the checkpoint `state` records, and not a later one either (a kill
    between best.pt and the checkpoint that follows it leaves best.pt ahead: the run redoes that epoch and
    writes it again): best.pt was put back from an earlier state of the run, or replaced."""
    epoch, loss, step = best
    progress = Progress.of(state)
    ahead = step > progress.step if step is not None else epoch > progress.epoch
    return not ahead and (epoch, loss) != (progress.best_epoch, progress.best_val_loss)


def best_disagreement(run: RunLayout, ckpt: dict) -> str | None:
    """Words where best.pt (`ckpt`, as the caller read it) is not the best model that the run's newest
    checkpoint records (put back from an earlier state of the run, or replaced by another run's): what an
    evaluation of it must say, since its skill is then not the skill of the run as it ended. None where it
    is, or where that cannot be told (no checkpoint, a best.pt without its record)."""
    best = _best_record(run, ckpt)
    if best is None:
        return None
    found = find_latest_valid(run)
    if found.state is None or found.folder is None or not _best_disagrees(best, found.state):
        return None
    newest = Progress.of(found.state)
    return (
        f"best.pt holds the best model of epoch {best[0]} (validation loss {best[1]:.4g}), but the run's "
        f"newest checkpoint ({found.folder.name}) records epoch {newest.best_epoch} (validation loss "
        f"{newest.best_val_loss:.4g}) as its best: best.pt was put back from an earlier state of the run, or "
        "replaced, so these scores are of that model, not of the run as it ended"
    )


def _agreeing_with_best(run: RunLayout, found: Found) -> Found:
    """The newest checkpoint whose record of the best model is best.pt's: `found` where it is; an earlier
    one, with the newer ones set aside, where best.pt was put back from an earlier state of the run (a
    backup copied over a run that went on: its end would have scored the earlier best as the run's, and
    called the run finished). Refused where no checkpoint agrees."""
    best = _best_record(run)
    assert found.state is not None and found.folder is not None
    if best is None or not _best_disagrees(best, found.state):
        return found
    newest = Progress.of(found.state)
    said = (
        f"{run.best} holds the best model of epoch {best[0]} (validation loss {best[1]:.4g}), "
        f"but checkpoint {found.folder.name} records epoch {newest.best_epoch} (validation loss "
        f"{newest.best_val_loss:.4g}) as the best: best.pt was put back from an earlier state of the run, "
        "or replaced"
    )
    for folder in find_checkpoints(run):
        named = step_of(folder)
        if named is None or named >= newest.step:
            continue
        reason, state, meta = check_folder(folder)
        if reason is None and state is not None and not _best_disagrees(best, state):
            step = int(Progress.of(state).step)
            newer = [p for p in find_checkpoints(run) if (step_of(p) or 0) > step]
            others = [p.name for p in newer if not ledger.mine(p)]
            if others:  # a backup's ledger put back too: it does not list what the run wrote after it
                raise CloudMLError(
                    f"{said}. The run can continue from step {step}, the newest checkpoint that agrees with "
                    f"best.pt, but the checkpoints after it ({', '.join(others)}) are not listed in the "
                    f"folder's record of what CloudML wrote ({ledger.LEDGER}, put back too?), so CloudML "
                    f"does not move them. Move them out of {run.checkpoints} (e.g. into a folder "
                    "beside the run), then run the same command again: the run continues from step "
                    f"{step}. Nothing was changed."
                )
            log.warning(
                "%s. The run continues from step %d, the newest checkpoint that agrees with best.pt (what "
                "was trained after it is trained again, as it was); the checkpoints after it are set aside.",
                said,
                step,
            )
            _set_aside_later_evaluation(run, step)  # first: it may refuse, nothing changed yet
            _set_aside_newer(run, step)
            return Found(folder, state, found.rejected, meta or {})
    raise CloudMLError(
        f"{said}, and no checkpoint of the run agrees with it. Ending the run would score that earlier model "
        f"as the run's best. Put back the best.pt of the same time as the checkpoints, continue from a "
        f"checkpoint of your choice (--resume {run.checkpoints}/step-N), or train afresh "
        "with --run-dir NEW. Nothing was changed."
    )


def _name_by_content(run: RunLayout, folder: Path, state: dict) -> Path:
    """A checkpoint is trusted by its content (the step in its verified state.pt), not by its folder's name.
    A name that says another step (renamed or copied by hand) is warned about, naming the folder; inside this
    run's checkpoints/ the folder then takes its content's name, or moves to rejected/ where a checkpoint
    holds that name already, so that it is neither resumed from again at every start nor kept from pruning.
    Returns where the folder is now."""
    step = int(Progress.of(state).step)
    if step_of(folder) == step:
        return folder
    ours = folder.parent.resolve() == run.checkpoints.resolve()
    right = folder.with_name(f"step-{step:08d}")
    taken = ours and os.path.lexists(right)
    moved = (
        right if not taken else run.path / REJECTED_DIR / f"{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
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


def _check_same_run(run: RunLayout, folder: Path, state: dict) -> None:
    """--resume PATH continues this run: a checkpoint from inside the run folder (checkpoints/, rejected/,
    superseded-*/), or one that carries this run's id (a copy of the whole run). Another run's checkpoint
    goes only into an empty folder, which then becomes a copy of that run from that step."""
    if run.path.resolve() in folder.resolve().parents:
        return
    theirs = Progress.of(state).run_id or None
    newest = find_latest_valid(run, load=False)
    ours = newest.meta.get("run_id") if newest.meta else None
    if theirs is not None and theirs == ours:
        return
    if has_run(run):
        raise CloudMLError(
            f"--resume {folder}: that checkpoint belongs to another run than the one in {run}. "
            f"To continue that run, use --run-dir with its own folder ({folder.parent.parent}); to "
            f"continue this one, use --resume auto. Nothing was changed."
        )
    log.warning(
        "Continuing in %s from %s, a checkpoint of another run folder: this folder becomes a copy of that "
        "run from step %d",
        run,
        folder,
        Progress.of(state).step,
    )


def _set_aside_newer(run: RunLayout, step: int) -> None:
    newer = [p for p in find_checkpoints(run) if (step_of(p) or 0) > step]
    newer = [p for p in newer if ledger.skip_unless_mine(p, "move aside")]  # another tool's step-* stays
    if newer:
        aside = run.path / f"{SUPERSEDED}{time.strftime('%Y%m%d-%H%M%S')}"
        ledger.add(aside)
        aside.mkdir(exist_ok=True)  # evaluation.json may have gone there this second
        for p in newer:
            p.rename(aside / p.name)
            ledger.drop(p)
        log.warning("Moved %d checkpoints newer than step %d to %s", len(newer), step, aside)


def _set_aside_later_evaluation(run: RunLayout, step: int) -> None:
    """evaluation.json of a later state of the run than the checkpoint it continues from (the run resumed
    from an earlier checkpoint: --resume PATH, or best.pt put back) is moved aside: trained again to the same
    step, the run would pass for ended with that earlier training's scores (and best.pt's cloud output not
    fitted again). Refused where it is not CloudML's, or changed since."""
    from cloudml_lib.base.runfiles import RunFiles

    evaluation = run.evaluation
    scored = RunFiles(run.path).evaluation().get("step") if evaluation.is_file() else None
    if not isinstance(scored, int) or scored <= step:
        return
    if not ledger.mine(evaluation) or ledger.changed(evaluation):
        raise CloudMLError(
            f"{evaluation} scored the run at step {scored}, later than the checkpoint it continues from "
            f"(step {step}), and is not CloudML's as written ({ledger.LEDGER} does not list it, or it was "
            "changed since), so CloudML does not move it. Move it out of the run folder, then run the same "
            "command again. Nothing was changed."
        )
    aside = run.path / f"{SUPERSEDED}{time.strftime('%Y%m%d-%H%M%S')}"
    ledger.add(aside)
    aside.mkdir(exist_ok=True)
    evaluation.rename(aside / evaluation.name)
    ledger.drop(evaluation)
    log.warning(
        "%s scored the run at step %d, later than the checkpoint it continues from (step %d): moved to %s; "
        "the run's end scores it anew",
        evaluation.name,
        scored,
        step,
        aside,
    )


def resumed_config(cfg, saved: dict):
    """The config a resumed run goes on with: `cfg`, with a batch size of "auto" as the run measured it when
    it started, and a setting added since the checkpoint was saved as that version computed it
    (absent_settings: an old run keeps its model.height_head). `cfg` itself is not changed."""
    changes = absent_settings(saved)
    if cfg.train.batch_size == "auto":  # measured once, when the run started
        changes["train.batch_size"] = saved["train"]["batch_size"]
    return derive(cfg, changes) if changes else cfg


# settings a user changes on purpose when continuing a run (the picker's Epochs; the run's patience)
ASKED_ON_RESUME = ("train.epochs ", "train.early_stopping_patience ")


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
        replanned = any(h.startswith("train.epochs ") for h in harmless)
        # more or fewer epochs is what a user continuing a run asks for (the notebook's picker offers it):
        # said, not warned of; another change taken from the new config is worth a look
        asked = all(h.startswith(ASKED_ON_RESUME) for h in harmless)
        (log.info if asked else log.warning)(
            "Resuming with changed settings (taken from the new config): %s%s",
            "; ".join(harmless),
            "; the cosine learning-rate decay is re-planned over the new length" if replanned else "",
        )


def recorded_files(run: RunLayout) -> dict[str, dict]:
    """Flight -> {role: SHA-256} of the files the run in `run` started from (its provenance.json)."""
    from cloudml_lib.core.run.provenance import read_run_provenance

    flights = (read_run_provenance(run) or {}).get("flights") or {}
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
    if not before or not now:
        return False
    return all(before.get(r) and before.get(r) == now.get(r) for r in now)


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
