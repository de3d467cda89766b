"""A sweep's Optuna study on disk: its journal, the copy kept in the sweep folder, and its rebuilding.

The study lives in an append-only journal on the local disk (Optuna's JournalStorage; SQLite on a Drive mount
loses progress, optuna #2582); `StudyFile` keeps its copy in the sweep folder, written whole after each ask,
epoch report and result, and restores it where the local file is missing (a new Colab VM), behind it, or
ahead of a copy this machine did not save last (the folder restored from a backup, or copied again). A
journal is read back line by line, each record checked for its shape (`journal_problem`); a lost or damaged
one is refused with what to do, or, when asked (`--rebuild-study`), rebuilt from the trial folders
(`rebuild_study`: each trial's values, state and epoch reports as its folder records them). Each trial's
sampler is seeded by the space's seed plus its number, and the pruner decides from stored values only
(`make_sampler`, `make_pruner`), so a study continued after a kill ends as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.outputs import atomic_path
from cloudml_lib.base.ownership import is_marked
from cloudml_lib.base.runfiles import RunFiles, numbered_folders
from cloudml_lib.base.shapes import INT, Damaged, Obj, parse_json
from cloudml_lib.commands.space import (
    LEGACY_OBJECTIVE,
    Space,
    choice_label,
    distributions,
)
from cloudml_lib.core.run.checkpoint import write_durable
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import (
    CROSSVAL,
    RUN,
)

log = logging.getLogger(__name__)

STUDY_NAME = "cloudml-sweep"
JOURNAL = "study.journal"
SAVED = "saved.json"  # beside the local journal


class StudyFile:
    """The study's journal on local disk and its copy in the sweep folder."""

    def __init__(self, sweep_folder: RunFolder):
        self.copy = sweep_folder.path / JOURNAL
        key = hashlib.sha1(str(sweep_folder.path.resolve()).encode()).hexdigest()[:12]
        self.local = Path(tempfile.gettempdir()) / f"cloudml-sweep-{key}" / JOURNAL
        # the size and sha256 of the copy this machine last wrote (or restored from): the local journal
        # continues the copy there only where the copy is still that one
        self.stamp = self.local.parent / SAVED

    def restore(self, has_trials: bool) -> str | None:
        """The journal to go on with: the local one when it extends the copy (this machine ran ahead of its
        last copy; the journal only grows, so "extends" is "starts with the copy's bytes"), else the copy,
        else (the copy lost or damaged) the local one. None when the sweep has no study yet; else what is
        wrong with it (lost, damaged), to refuse: `has_trials` says that trials ran, so a new study would
        be built over them."""
        self.local.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.local.parent.glob(f"{JOURNAL}.lock*"):  # a killed writer's; the sweep lock is ours
            stale.unlink(missing_ok=True)
        saved, saved_problem = _read_journal(self.copy)
        here, here_problem = _read_journal(self.local)
        saved, here = _whole_lines(saved, self.copy), _whole_lines(here, self.local)
        if saved is not None and here is not None and here.startswith(saved):
            if here == saved or self._saved_here(saved):
                return None
            log.warning(
                "%s goes further than %s, which is not the copy this machine saved last (the sweep folder "
                "was restored or copied from elsewhere since): the sweep goes on from %s",
                self.local,
                self.copy,
                self.copy,
            )
        if saved is not None:
            self.local.write_bytes(saved)
            self._stamp(saved)
            log.info("Study restored from %s", self.copy)
            return None
        if here is not None and has_trials:
            log.warning(
                "%s is %s: the study goes on from this machine's copy %s",
                self.copy,
                saved_problem,
                self.local,
            )
            return None
        self.local.unlink(missing_ok=True)  # the study of a sweep folder since deleted, or a damaged one
        return (
            f"{self.copy} is {saved_problem}" if has_trials or saved_problem.startswith("damaged") else None
        )

    def save(self) -> None:
        """Copy the journal whole (temporary file, fsync, rename): a kill leaves the old copy or the new. Its
        whole lines only: a worker of a parallel sweep may be appending one. A copy changed since CloudML
        wrote it (damaged, a line cut, or edited: restore left out what it could not read) is kept under
        another name first, as it is."""
        data = self.local.read_bytes()
        data = data[: data.rfind(b"\n") + 1]
        with atomic_path(self.copy) as tmp:  # a copy changed since: kept as study.journal.kept-N first
            write_durable(tmp, data)
        self._stamp(data)

    def _stamp(self, copy: bytes) -> None:
        """Remember the copy as this machine wrote or read it (a temporary file, then a rename)."""
        tmp = self.stamp.with_name(f".{SAVED}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"size": len(copy), "sha256": hashlib.sha256(copy).hexdigest()}))
        os.replace(tmp, self.stamp)

    def _saved_here(self, copy: bytes) -> bool:
        """The copy in the sweep folder is the one this machine saved last (so a local journal that goes
        further holds only what a kill kept from the copy). No stamp (a journal of an earlier release, a
        damaged stamp): not known, so no."""
        try:
            stamp = json.loads(self.stamp.read_text())
        except (OSError, ValueError):
            return False
        return (
            isinstance(stamp, dict)
            and stamp.get("size") == len(copy)
            and stamp.get("sha256") == hashlib.sha256(copy).hexdigest()
        )

    def storage(self, optuna):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(self.local)))


def _read_journal(path: Path) -> tuple[bytes | None, str]:
    """(a journal's bytes, "") when it is usable, else (None, what is wrong: missing, empty, damaged)."""
    try:
        if path.is_symlink() or not path.is_file():
            return None, "missing"
        data = path.read_bytes()
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    problem = journal_problem(data)
    return (None, problem) if problem else (data, "")


def _whole_lines(data: bytes | None, path: Path) -> bytes | None:
    """A journal without a last line cut by a kill (a torn write, which Optuna's reader would choke on
    later): the bytes up to its last newline, said once."""
    if data is None or data.endswith(b"\n"):
        return data
    cut = data.rfind(b"\n") + 1
    log.warning("%s ends in a line cut by an interruption (%d bytes): it is left out", path, len(data) - cut)
    return data[:cut] or None


JOURNAL_RECORD = Obj({"op_code": INT}, required=("op_code",))  # what a line of an Optuna journal holds


def journal_problem(data: bytes) -> str | None:
    """What is wrong with an Optuna journal's bytes, or None. Every complete line is a JSON record with an
    op_code, the first creating the study; a last line without its newline is a write cut by a kill
    (Optuna skips it)."""
    lines = data.split(b"\n")[:-1]
    if not lines:
        return "empty"
    for i, line in enumerate(lines, 1):
        try:
            record = parse_json(line, JOURNAL_RECORD)
        except Damaged as e:
            return f"damaged (line {i} is not an Optuna journal record: {e})"
        if i == 1 and record["op_code"] != 0:
            return "damaged (it does not start by creating the study)"
    return None


def make_sampler(optuna, space: Space, number: int):
    """A sampler for trial `number` alone: seeded by seed + number, so a restart draws the same values."""
    seed = space.seed + number
    if space.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(optuna, space: Space):
    if space.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=space.prune_startup_trials, n_warmup_steps=space.prune_after_epochs
        )
    return optuna.pruners.NopPruner()


def load_study(optuna, store: StudyFile, space: Space):
    """The study from the local journal (created when there is none); a journal Optuna cannot replay is
    damaged."""
    try:
        return optuna.create_study(
            study_name=STUDY_NAME,
            storage=store.storage(optuna),
            load_if_exists=True,
            direction=space.direction,
            pruner=make_pruner(optuna, space),
        )
    except Exception as e:  # noqa: BLE001 - any failure to replay the file is the file's damage
        raise CloudMLError(
            lost_study_message(
                f"{store.copy} is damaged (Optuna cannot replay it: {shown(e)})",
                RunFolder(store.copy.parent),
                0,
            )
        ) from None


def behind_folders(study, folders: list[Path]) -> str | None:
    """A study that knows fewer trials than the sweep folder holds lost some (a journal replaced by an
    older one): each trial is asked, and saved, before its folder is made."""
    if folders and int(folders[-1].name) >= len(study.trials):
        return (
            f"{JOURNAL} knows {len(study.trials)} trial(s) but the folder holds trials/{folders[-1].name}: "
            "the journal is older than the trials"
        )
    return None


def lost_study_message(problem: str, sweep_folder: RunFolder, n_folders: int) -> str:
    held = f"its {n_folders} trial folder(s)" if n_folders else "its trial folders"
    return (
        f"{problem}. The journal is the sweep's memory of its trials: a new study would run trials again, "
        f"with other values, and report different results. Restore {JOURNAL} (from a copy, or Drive's "
        f"version history), or run the same command with --rebuild-study to rebuild the study from {held} in "
        f"{sweep_folder.path / 'trials'} (each trial's values, state and result from trial.json, its epoch "
        "scores from metrics.jsonl). Nothing was changed."
    )


def rebuild_study(optuna, store: StudyFile, sweep_folder: RunFolder, space: Space):
    """A new study holding the trials of the sweep folder, in their order (the sampler then draws what it
    would have drawn: it sees the same history); a missing trial number is a failed trial."""
    store.local.parent.mkdir(parents=True, exist_ok=True)
    store.local.unlink(missing_ok=True)
    study = optuna.create_study(
        study_name=STUDY_NAME,
        storage=store.storage(optuna),
        direction=space.direction,
        pruner=make_pruner(optuna, space),
    )
    folders = sweep_trials(sweep_folder)
    for number in range(max(folders, default=-1) + 1):
        found = folders.get(number)
        study.add_trial(rebuilt_trial(optuna, None if found is None else RunFolder(found), space))
    log.warning("Study rebuilt from %d trial folder(s) in %s", len(folders), sweep_folder.path / "trials")
    return study


def sweep_trials(sweep_folder: RunFolder) -> dict[int, Path]:
    """The trial folders that are this sweep's (trials/<n> whose trial.json names trial n, or that carry
    CloudML's run marker), by number. A folder of another number or of other things is not a trial: it is
    named and left as it is, and it never stands for trials that did not run (the numbers between)."""
    own, strays = {}, []
    for folder in numbered_folders(sweep_folder.path / "trials"):
        info = RunFiles(folder).trial()
        if info.get("number") == int(folder.name) or any(is_marked(folder, k.name) for k in (RUN, CROSSVAL)):
            own[int(folder.name)] = folder
        else:
            strays.append(folder.name)
    if strays:
        log.warning(
            "%s holds folders that are no trial of this sweep (%s): left as they are, not counted",
            sweep_folder.path / "trials",
            ", ".join(strays[:5]) + (f" and {len(strays) - 5} more" if len(strays) > 5 else ""),
        )
    return own


def rebuilt_trial(optuna, trial: RunFolder | None, space: Space):
    """One trial from its folder: trial.json's values, state, result and note; metrics.jsonl's epoch
    scores."""
    states = {
        "running": optuna.trial.TrialState.RUNNING,
        "complete": optuna.trial.TrialState.COMPLETE,
        "pruned": optuna.trial.TrialState.PRUNED,
        "failed": optuna.trial.TrialState.FAIL,
    }
    files = RunFiles(trial.path) if trial is not None else None
    info = files.trial() if files is not None else {}
    lost = optuna.trial.create_trial(
        state=optuna.trial.TrialState.FAIL,
        user_attrs={
            "note": f"lost: {'no folder' if trial is None else 'its trial.json is missing or damaged'}"
        },
    )
    if not info or trial is None:
        return lost
    reports = {} if trial.is_crossval() else epoch_reports(files, space.metric)
    try:
        return optuna.trial.create_trial(
            state=states[info["state"]],
            params={
                k: choice_label(v) if "choices" in space.params.get(k, {}) else v
                for k, v in info["params"].items()
            },
            distributions=distributions(space),
            value=_rebuilt_value(info, reports, _evaluated(files, space)),
            intermediate_values=reports,
            user_attrs={"note": info["note"]} if info.get("note") else {},
        )
    except (ValueError, TypeError) as e:  # values outside the space: not this sweep's trial
        log.warning("%s cannot be rebuilt (%s): counted as failed", trial.trial, shown(e))
        return lost


def _evaluated(files: RunFiles, space: Space) -> float | None:
    """The trial's metric from its own evaluation.json (its validation score; the test score for a sweep of
    CloudML 0.2), or None (a cross-validation objective)."""
    if space.objective == "crossval":
        return None
    evaluation = files.evaluation()
    scores = (
        evaluation.get("overall") if space.objective == LEGACY_OBJECTIVE else evaluation.get("validation")
    )
    value = ((scores or {}).get("pooled", scores) or {}).get(space.metric)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _rebuilt_value(info: dict, reports: dict[int, float], measured: float | None = None) -> float | None:
    """A complete trial's result (the one its own evaluation.json gives, where trial.json says another); a
    pruned trial's is its last epoch score, as Optuna records it."""
    if info["state"] == "complete":
        value = info.get("value")
        if measured is not None and (not isinstance(value, (int, float)) or abs(value - measured) > 1e-9):
            log.warning(
                "trial %s: trial.json says %s, its evaluation.json %.6g: the evaluation's value is used",
                info.get("number"),
                shown(value),
                measured,
            )
            return measured
        return value
    if info["state"] == "pruned" and reports and math.isfinite(reports[max(reports)]):
        return reports[max(reports)]
    return None


def epoch_reports(files: RunFiles, metric: str) -> dict[int, float]:
    """A trial run's per-epoch metric as the pruner was told it (a missing value is NaN)."""
    out = {}
    for r in files.metrics():
        if r["kind"] == "epoch" and "epoch" in r:
            value = r.get(metric)
            out[r["epoch"]] = float("nan") if value is None else float(value)
    return out
