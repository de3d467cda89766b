"""Hyperparameter sweeps on Optuna that survive a disconnect: `python -m cloudml_lib sweep`.

A sweep folder on Drive:
- `sweep.json`        the config, the search space (space.py) and the number of trials asked for
- `study.journal`     the copy of Optuna's study, refreshed after each ask, epoch report and result
- `trials/<n>/`       trial n: an ordinary resumable run (or cross-validation), `trial.json` its values
- `report.md`, `plots/`  the trials table, the optimisation history, the importance of each parameter

The study lives on local disk (Optuna's JournalStorage: an append-only file; SQLite on a Drive mount
loses progress, optuna #2582) and its copy in the sweep folder is restored when the local file is
missing (a new Colab VM) or behind it. Killed at any moment and run again, the sweep continues: a trial
left running resumes from its own checkpoint with its stored values, finished trials are not rerun,
and the study ends as an uninterrupted one, because each trial's sampler is seeded by the space's seed
plus the trial's number (a suggestion depends on the history only, never on RNG state lost at a kill)
and the pruner decides from stored values only.

Under torchrun, rank 0 asks, reports and writes the study; every trial runs with all processes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
from pathlib import Path

from cloudml_lib import faults
from cloudml_lib.checkpoint import write_durable
from cloudml_lib.config import apply_overrides, build_config
from cloudml_lib.distributed import Dist, init_distributed
from cloudml_lib.errors import CloudMLError, ConfigError, install_command
from cloudml_lib.logs import attach_run_log
from cloudml_lib.outputs import atomic_path, json_safe, write_text
from cloudml_lib.rundir import flatten_keys, has_run, is_crossval
from cloudml_lib.runlock import RunLock
from cloudml_lib.space import Space, load_space, suggest, trial_raw
from cloudml_lib.yamlfile import read_yaml

log = logging.getLogger(__name__)

STUDY_NAME = "cloudml-sweep"
JOURNAL = "study.journal"


def require_optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError(
            f"sweeps run on Optuna, which is not installed: {install_command('optuna>=4.0')} (and matplotlib "
            "for "
            "the report's images), then run the same command again"
        ) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep says what happens, once
    return optuna


class StudyFile:
    """The study's journal on local disk and its copy in the sweep folder."""

    def __init__(self, run_dir: Path):
        self.copy = Path(run_dir) / JOURNAL
        key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
        self.local = Path(tempfile.gettempdir()) / f"cloudml-sweep-{key}" / JOURNAL

    def restore(self) -> None:
        """The local journal: kept when it extends the copy (this machine ran ahead of its last copy), else
        the copy. The journal only grows, so "extends" is "starts with the copy's bytes"."""
        self.local.parent.mkdir(parents=True, exist_ok=True)
        for stale in self.local.parent.glob(f"{JOURNAL}.lock*"):  # a killed writer's; the sweep lock is ours
            stale.unlink(missing_ok=True)
        saved = self.copy.read_bytes() if self.copy.is_file() else None
        here = self.local.read_bytes() if self.local.is_file() else None
        if saved is None:
            self.local.unlink(missing_ok=True)  # the study of a sweep folder since deleted
        elif here is None or not here.startswith(saved):
            self.local.write_bytes(saved)
            log.info("Study restored from %s", self.copy)

    def save(self) -> None:
        """Copy the journal whole (temporary file, fsync, rename): a kill leaves the old copy or the new."""
        with atomic_path(self.copy) as tmp:
            write_durable(tmp, self.local.read_bytes())

    def storage(self, optuna):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(self.local)))


def check_sweep_folder(run_dir: Path, record: dict) -> None:
    """A sweep folder is not a run's; a sweep started again keeps its config and space (more trials may be
    asked for)."""
    if has_run(run_dir) or is_crossval(run_dir):
        raise CloudMLError(
            f"{run_dir} holds a training run or cross-validation, not a sweep; choose another "
            "--run-dir for the sweep. Nothing was changed."
        )
    path = run_dir / "sweep.json"
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    diffs = [
        f"{k} (sweep {a!r}, now {b!r})"
        for part in ("config", "space")
        for k, a, b in _differences(saved[part], record[part], part)
    ]
    if diffs:
        raise ConfigError(
            f"{run_dir} is a sweep with other settings: {'; '.join(diffs)}. Its trials would not be "
            "comparable: use the same config and space to continue it, or another --run-dir for a "
            "new sweep. Nothing was changed."
        )


def _differences(a: dict, b: dict, prefix: str) -> list[tuple[str, object, object]]:
    fa, fb = flatten_keys(a, f"{prefix}."), flatten_keys(b, f"{prefix}.")
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


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


def next_trial(optuna, study, space: Space, n_trials: int):
    """The trial left running by an interrupted sweep, else a new one while fewer than `n_trials` exist."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    if running:
        log.info(
            "Trial %d was interrupted: it resumes from its checkpoint with its values", running[0].number
        )
        study.sampler = make_sampler(
            optuna, space, running[0].number
        )  # for a value not drawn before the kill
        return optuna.trial.Trial(study, running[0]._trial_id)
    if len(study.trials) >= n_trials:
        return None
    study.sampler = make_sampler(optuna, space, len(study.trials))
    return study.ask()


class Pruning:
    """After each epoch: rank 0 reports the epochs not yet reported and asks the pruner; every rank stops
    the trial together (optuna.TrialPruned). After the last epoch nothing is pruned: the trial has cost
    all its training already, and its evaluation is its result."""

    def __init__(self, optuna, trial, space: Space, store: StudyFile | None, dist: Dist, epochs: int):
        self.optuna, self.trial, self.space, self.store, self.dist = optuna, trial, space, store, dist
        self.epochs = epochs

    def __call__(self, history: list[dict]) -> None:
        why = None
        if self.dist.is_main:
            reported = self.stored().intermediate_values
            for h in history:
                if h["epoch"] not in reported:
                    value = h[self.space.metric]
                    self.trial.report(float("nan") if value is None else value, h["epoch"])
            if history[-1]["epoch"] < self.epochs and self.trial.should_prune():
                # the newest report decides, which a resumed trial may hold from before its checkpoint
                epoch, value = max(self.stored().intermediate_values.items())
                why = (
                    f"after epoch {epoch}, its {self.space.metric} ({value:.4g}) was worse than the median "
                    "of the "
                    "earlier trials at that epoch"
                )
            self.store.save()
        why = self.dist.from_main(why)
        if why is not None:
            raise self.optuna.TrialPruned(why)

    def stored(self):
        """The trial as the study holds it now (its reports, including those made before a resume)."""
        return next(t for t in self.trial.study.get_trials(deepcopy=False) if t.number == self.trial.number)


def objective_value(space: Space, cfg, trial_dir: Path, pruning: Pruning, dist: Dist) -> float:
    """The trial's held-out (or cross-validated) metric; its run resumes from its own checkpoint."""
    if space.objective == "crossval":
        from cloudml_lib.crossval import crossval

        result = crossval(cfg, trial_dir, controls=False, dist=dist)
        value = dist.from_main(result["summary"]["model"][space.metric]["mean"] if dist.is_main else None)
        return value
    from cloudml_lib.train import Trainer, train_two_phase

    if cfg.train.pretrain_flight:
        report = train_two_phase(cfg, trial_dir, "auto", dist)
    else:
        report = Trainer(cfg, trial_dir, "auto", dist=dist).setup().fit(after_epoch=pruning)
    return report["overall"][space.metric]


def run_trial(
    optuna,
    trial,
    number: int,
    params: dict,
    base: dict,
    space: Space,
    run_dir: Path,
    store: StudyFile | None,
    dist: Dist,
) -> tuple[str, float | None, str]:
    """(state, value, note): complete, pruned or failed (a config the values make invalid, a metric that is
    not a number). Other errors stop the sweep with the trial left running, to be resumed."""
    trial_dir = run_dir / "trials" / str(number)
    try:
        cfg = build_config(trial_raw(base, params), source=f"trial {number}'s config")
    except ConfigError as e:
        return "failed", None, str(e)
    if dist.is_main:
        trial_dir.mkdir(parents=True, exist_ok=True)
        write_text(
            trial_dir / "trial.json",
            json.dumps(json_safe({"number": number, "params": params, "state": "running"}), indent=1),
        )
    try:
        pruning = Pruning(optuna, trial, space, store, dist, cfg.train.epochs)
        value = objective_value(space, cfg, trial_dir, pruning, dist)
    except optuna.TrialPruned as e:
        return "pruned", None, str(e)
    if value is None or not math.isfinite(value):
        return "failed", None, f"{space.metric} is {value} (training diverged?)"
    return "complete", float(value), ""


def sweep(
    config: str | Path,
    space_path: str | Path,
    n_trials: int,
    run_dir: str | Path,
    overrides: list[str] | tuple = (),
    dist: Dist | None = None,
) -> dict:
    """Run (or continue) a sweep of `n_trials` trials; returns {"best": ..., "trials": [...]} on rank 0."""
    run_dir = Path(run_dir)
    base = apply_overrides(read_yaml(config), list(overrides))
    build_config(base, source=str(config))  # the config itself first, then the space over it
    space = load_space(space_path, base)
    if not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"--trials {n_trials!r}: expected a whole number of trials >= 1")
    optuna = require_optuna()
    own_dist = dist is None
    dist = init_distributed(build_config(base).train.device) if own_dist else dist
    record = {"config": base, "space": space.to_dict(), "trials": n_trials, "config_file": str(config)}
    lock = store = study = None
    try:
        if dist.is_main:
            lock, store, study = open_study(optuna, run_dir, record, space)
        run_trials(optuna, study, store, space, base, n_trials, run_dir, dist)
        if not dist.is_main:
            return {}
        from cloudml_lib.compare import sweep_summary, write_sweep_report

        write_sweep_report(study, run_dir, space)
        return sweep_summary(study, space)
    finally:
        if lock is not None:
            lock.release()
        if own_dist:
            dist.close()


def open_study(optuna, run_dir: Path, record: dict, space: Space) -> tuple:
    """Rank 0: the sweep folder checked and locked, sweep.json written, the study restored (or created) from
    its journal. Returns (lock, journal, study)."""
    check_sweep_folder(run_dir, record)
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        write_text(run_dir / "sweep.json", json.dumps(json_safe(record), indent=1))
        store = StudyFile(run_dir)
        store.restore()
        study = optuna.create_study(
            study_name=STUDY_NAME,
            storage=store.storage(optuna),
            load_if_exists=True,
            direction=space.direction,
            pruner=make_pruner(optuna, space),
        )
        store.save()
    except BaseException:
        lock.release()
        raise
    return lock, store, study


def run_trials(
    optuna, study, store, space: Space, base: dict, n_trials: int, run_dir: Path, dist: Dist
) -> None:
    """Trial after trial until `n_trials` are done: rank 0 asks (or takes back a trial left running), every
    process trains it, rank 0 tells its result and rewrites the report."""
    from cloudml_lib.compare import write_sweep_report

    while True:
        trial = job = None
        if dist.is_main:
            attach_run_log(run_dir)
            trial = next_trial(optuna, study, space, n_trials)
            job = None if trial is None else (trial.number, suggest(trial, space))
            store.save()  # the trial and its values, before any training
        job = dist.from_main(job)
        if job is None:
            return
        number, params = job
        log.info(
            "Trial %d (%d of %d): %s",
            number,
            number + 1,
            n_trials,
            ", ".join(f"{k}={v}" for k, v in params.items()),
        )
        state, value, note = run_trial(optuna, trial, number, params, base, space, run_dir, store, dist)
        if dist.is_main:
            attach_run_log(run_dir)
            finish_trial(optuna, study, trial, (state, value, note), params, space, run_dir)
            store.save()
            write_sweep_report(study, run_dir, space)


def finish_trial(optuna, study, trial, result: tuple, params: dict, space: Space, run_dir: Path) -> None:
    """Tell the study the trial's (state, value, note), write trial.json, and say it."""
    state, value, note = result
    states = {
        "complete": optuna.trial.TrialState.COMPLETE,
        "pruned": optuna.trial.TrialState.PRUNED,
        "failed": optuna.trial.TrialState.FAIL,
    }
    if note:
        trial.set_user_attr("note", note)
    study.tell(trial, value if state == "complete" else None, state=states[state])
    trial_dir = run_dir / "trials" / str(trial.number)
    trial_dir.mkdir(parents=True, exist_ok=True)
    write_text(
        trial_dir / "trial.json",
        json.dumps(
            json_safe(
                {"number": trial.number, "params": params, "state": state, "value": value, "note": note}
            ),
            indent=1,
        ),
    )
    if state == "complete":
        log.info(
            "Trial %d: %s %.4f (best so far: trial %d, %.4f)",
            trial.number,
            space.metric,
            value,
            study.best_trial.number,
            study.best_value,
        )
    else:
        log.warning("Trial %d %s: %s", trial.number, state, note)
    faults.point("sweep-told")
