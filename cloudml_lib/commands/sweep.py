"""Hyperparameter sweeps on Optuna that survive a disconnect: `python -m cloudml_lib sweep`.

A sweep folder on Drive:
- `sweep.json`        the config, the search space (space.py) and the number of trials asked for
- `study.journal`     the copy of Optuna's study, refreshed after each ask, epoch report and result
- `trials/<n>/`       trial n: an ordinary resumable run (or cross-validation), `trial.json` its values
- `report.md`, `plots/`  the trials table, the optimisation history, the importance of each parameter

The study lives on local disk (Optuna's JournalStorage: an append-only file; SQLite on a Drive mount loses
progress, optuna #2582) and its copy in the sweep folder is restored when the local file is missing (a new
Colab VM) or behind it (study.py). Killed at any moment and run again, the sweep continues: a trial left
running resumes from its own checkpoint with its stored values, finished trials are not rerun, and the study
ends as an uninterrupted one, because each trial's sampler is seeded by the space's seed plus the trial's
number (a suggestion depends on the history only, never on RNG state lost at a kill) and the pruner decides
from stored values only.

Each trial is scored on its validation data (objective validation; crossval: the mean of its nested folds'
validation scores), never on a test flight: the best trial is chosen there, and its test score is reported
once, beside it (compare.write_sweep_report). A sweep started by CloudML 0.2 (objective held_out, which
chose on the test flights) continues under that protocol, said in its report.

Under torchrun, rank 0 asks, reports and writes the study; every trial runs with all processes.

With `--parallel N` (run_parallel), N trials train at once, one worker process each (trialpool.py: a GPU
each where there are several, else cores // N threads each); this process still asks, tells and writes
every file of the sweep folder but the trials' own, and the workers report their epochs to the same local
journal. A serial sweep is reproducible to the value; in a parallel one, trial n still draws with seed + n
but from the trials finished when it was asked (TPE leaves the running ones out, as Optuna does), which
depends on timing: random draws, and TPE's random start (trials 0 to 9), are a serial sweep's; TPE's later
draws and the median pruner's decisions can differ. Each trial still trains, and resumes, to its own
result; killed, a parallel sweep continues as a serial one does (in parallel or not).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from cloudml_lib.base import faults
from cloudml_lib.base.config import (
    LEGACY_VALIDATION,
    PATH_KEYS,
    absent_settings,
    apply_overrides,
    build_config,
    derive,
)
from cloudml_lib.base.errors import CloudMLError, ConfigError, TransientError, install_command, shown
from cloudml_lib.base.files import read_text
from cloudml_lib.base.logs import attach_run_log
from cloudml_lib.base.outputs import json_safe, write_text
from cloudml_lib.base.ownership import Kind, check, claim
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.base.shapes import TEXT, Damaged, Obj, parse_json
from cloudml_lib.base.yamlfile import read_yaml
from cloudml_lib.commands.space import (
    LEGACY_OBJECTIVE,
    MAX_SEED,
    Space,
    check_flights,
    load_space,
    suggest,
    trial_raw,
)
from cloudml_lib.commands.study import (
    STUDY_NAME,
    StudyFile,
    behind_folders,
    load_study,
    lost_study_message,
    make_pruner,
    make_sampler,
    rebuild_study,
    sweep_trials,
)
from cloudml_lib.commands.trialpool import Workers, check_parallel, serve
from cloudml_lib.core.machine.distributed import SINGLE, Dist, init_distributed
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import (
    CROSSVAL,
    RUN,
    SWEEP_KIND,
    adopt_run,
    flatten_keys,
    has_run,
    is_crossval,
)
from cloudml_lib.core.run.runlock import RunLock

log = logging.getLogger(__name__)


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


SWEEP = Kind(
    SWEEP_KIND,
    "--run-dir",
    adopt_sweep,
    "an existing sweep folder to continue that sweep",
    continued_by="sweep ...",
)


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


def check_sweep_folder(folder: RunFolder, record: dict) -> None:
    """A sweep folder is not a run's; a sweep started again keeps its config and space (more trials may be
    asked for)."""
    check(folder.path, SWEEP)  # CloudML's own folder, or an earlier sweep's that verifies
    if has_run(folder) or is_crossval(folder):
        raise CloudMLError(
            f"{folder} holds a training run or cross-validation, not a sweep; choose another "
            "--run-dir for the sweep. Nothing was changed."
        )
    files = RunFiles(folder.path)
    saved = files.sweep()
    if files.damaged:
        raise ConfigError(
            f"{files.damaged[0]}. It records the config and space this sweep started with. Restore it, or "
            "move it aside to continue the sweep with the config and space given now (its trials and "
            "study.journal stay). Nothing was changed."
        )
    if saved is None:
        return
    # where the flights and the cache are is no setting (a Drive folder moved): each trial's run checks its
    # flights by content when it resumes, as every run does
    locations = {f"config.data.{key}" for key in PATH_KEYS}
    moved = [k for k, _, _ in _differences(saved["config"], record["config"], "config") if k in locations]
    if moved:
        log.info("%s: the sweep's %s moved since it started; its trials check their flights by content",
                 folder, ", ".join(k.removeprefix("config.") for k in moved))  # fmt: skip
    diffs = [
        f"{k} (sweep {a!r}, now {b!r})"
        for part in ("config", "space")
        for k, a, b in _differences(saved[part], record[part], part)
        if k not in locations
    ]
    if diffs:
        raise ConfigError(
            f"{folder} is a sweep with other settings: {'; '.join(diffs)}. Its trials would not be "
            "comparable: use the same config and space to continue it, or another --run-dir for a "
            "new sweep. Nothing was changed."
        )


def _differences(a: dict, b: dict, prefix: str) -> list[tuple[str, object, object]]:
    fa, fb = flatten_keys(a, f"{prefix}."), flatten_keys(b, f"{prefix}.")
    return [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def next_trial(optuna, study, space: Space, n_trials: int, held=()):
    """The trial left running by an interrupted sweep, else a new one while fewer than `n_trials` exist.
    `held`: the numbers of the trials this sweep's workers are running now (trialpool.py), not to be taken."""
    running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    running = [t for t in running if t.number not in held]
    if running:
        log.info(
            "Trial %d was interrupted: it resumes from its checkpoint with its values", running[0].number
        )
        study.sampler = make_sampler(
            optuna, space, running[0].number
        )  # for a value not drawn before the kill
        return optuna.trial.Trial(study, running[0]._trial_id)
    waiting = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
    if not waiting and len(counted(optuna, study)) >= n_trials:
        return None
    study.sampler = make_sampler(optuna, space, len(study.trials))
    return study.ask()  # a waiting trial (one trained again: retry_passing_failures) first


# What an earlier release failed a trial for, for good, though the cause passes (a full disk, a folder made
# read-only, a device out of memory): this release leaves such a trial running, to resume (TransientError).
PASSING_CAUSES = (
    "could not be written",
    "no space left on device",
    "[errno 28]",
    "[errno 122]",
    "disk quota exceeded",
    "out of memory",
)


def failed_for_a_passing_cause(optuna, trial) -> bool:
    note = str(trial.user_attrs.get("note") or "").lower()
    return trial.state == optuna.trial.TrialState.FAIL and any(cause in note for cause in PASSING_CAUSES)


def counted(optuna, study) -> list:
    """The trials that count towards --trials: all but those an earlier release failed for a passing cause
    (each is trained again as a new trial)."""
    return [t for t in study.get_trials(deepcopy=False) if not failed_for_a_passing_cause(optuna, t)]


def retry_passing_failures(optuna, study) -> None:
    """Each trial an earlier release failed for a passing cause, and not trained again yet, is queued to be
    trained again with its values (a new trial, its own folder; the failed one stays in the study, said)."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    for t in trials:
        if failed_for_a_passing_cause(optuna, t) and t.number not in retried:
            study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
            log.warning(
                "Trial %d failed in an earlier run for a cause that passes (%s): it is trained again, as a "
                "new trial with the same values; it does not count towards --trials.",
                t.number,
                shown(t.user_attrs.get("note"), 300),
            )


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
            if self.store is not None:  # a worker of a parallel sweep: the owner refreshes the copy
                self.store.save()
        why = self.dist.from_main(why)
        if why is not None:
            raise self.optuna.TrialPruned(why)

    def stored(self):
        """The trial as the study holds it now (its reports, including those made before a resume)."""
        return next(t for t in self.trial.study.get_trials(deepcopy=False) if t.number == self.trial.number)


def objective_value(space: Space, cfg, trial: RunFolder, pruning: Pruning, dist: Dist) -> float:
    """The trial's metric on its validation data (the mean over the nested folds' validation data for
    objective crossval; on the test flights for a sweep of CloudML 0.2, objective held_out); its run resumes
    from its own checkpoint. No test flight decides a new sweep's best trial."""
    if space.objective == "crossval":
        from cloudml_lib.commands.crossval import crossval

        result = crossval(cfg, trial, controls=False, dist=dist, adapt=False)
        return dist.from_main(crossval_value(result, space.metric) if dist.is_main else None)
    from cloudml_lib.commands.runs import run_to_end

    report = run_to_end(cfg, trial, "auto", dist, after_epoch=pruning)
    if space.objective == LEGACY_OBJECTIVE:
        return report["overall"][space.metric]
    return (report.get("validation") or {}).get("pooled", {}).get(space.metric)


def crossval_value(result: dict, metric: str) -> float | None:
    """A cross-validation trial's value: the mean over its folds of the fold's validation score (a sweep of
    CloudML 0.2: of the fold's test score)."""
    folds = result.get("folds") or {}
    if result.get("protocol") == LEGACY_VALIDATION:
        return result["summary"]["model"][metric]["mean"]
    values = [(f.get("validation") or {}).get(metric) for f in folds.values()]
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return float(sum(values) / len(values)) if values and len(values) == len(folds) else None


@dataclass
class SweepRun:
    """A sweep being run: Optuna (imported on demand), its study and journal (rank 0's; None elsewhere), the
    space, the config the trials start from, how many trials in all, the sweep folder, the processes."""

    optuna: object
    study: object
    store: StudyFile | None
    space: Space
    base: dict
    n_trials: int
    folder: RunFolder
    dist: Dist
    started: dict  # what a sweep started by an earlier release keeps in its new trials (started_settings)


def run_trial(sw: SweepRun, trial, number: int, params: dict) -> tuple[str, float | None, str]:
    """(state, value, note): complete, pruned or failed (a config the values make invalid, a trial its
    set-up or training refuses, such as a batch larger than the training set, or a metric that is not a
    number). A stop, a full disk or an unexpected error stops the sweep with the trial left running, to be
    resumed."""
    optuna, space, dist = sw.optuna, sw.space, sw.dist
    trial_run = RunFolder(sw.folder.path / "trials" / str(number))
    try:
        cfg = build_config(trial_raw(sw.base, params), source=f"trial {number}'s config")
        if sw.started:  # a sweep of an earlier release goes on under its protocol and settings
            cfg = derive(cfg, sw.started)
    except ConfigError as e:
        return "failed", None, str(e)
    if dist.is_main:
        claim(trial_run.path, trial_kind(space))  # the trial's folder, marked before trial.json goes into it
        write_text(
            trial_run.trial,
            json.dumps(json_safe({"number": number, "params": params, "state": "running"}), indent=1),
        )
    try:
        pruning = Pruning(optuna, trial, space, sw.store, dist, cfg.train.epochs)
        value = objective_value(space, cfg, trial_run, pruning, dist)
    except optuna.TrialPruned as e:
        return "pruned", None, str(e)
    except TransientError:  # a full disk: the sweep stops, the trial left running resumes when run again
        raise
    except CloudMLError as e:  # the same values would be refused again: the trial is over, the sweep goes on
        return "failed", None, str(e)
    if value is None or not math.isfinite(value):
        return "failed", None, f"{space.metric} is {value} (training diverged?)"
    return "complete", float(value), ""


def sweep(
    config: str | Path,
    space_path: str | Path,
    n_trials: int,
    folder: RunFolder,
    overrides: list[str] | tuple = (),
    dist: Dist | None = None,
    rebuild: bool = False,
    parallel: int = 1,
) -> dict:
    """Run (or continue) a sweep of `n_trials` trials; returns {"best": ..., "trials": [...]} on rank 0.
    `rebuild`: a lost or damaged study.journal is rebuilt from the trial folders (else refused). `parallel`:
    how many trials run at once, one per process (trialpool.py); 1 runs them one after another."""
    base = apply_overrides(read_yaml(config), list(overrides))
    build_config(base, source=str(config))  # the config itself first, then the space over it
    space = load_space(space_path, base)
    check_trials(n_trials, space)
    parallel = check_parallel(parallel, n_trials, "trials", "sweep", dist)
    optuna = require_optuna()  # before anything is written (the demo's flights took 10 s to be refused)
    if build_config(base).data.demo:  # written before the flights are looked at, as a command starts
        from cloudml_lib.commands.runs import with_demo_flights

        with_demo_flights(build_config(base), SINGLE if dist is None else dist)
    check_flights(space, base)  # flight names in the space against the flights found: before any trial
    own_dist = dist is None
    dist = init_distributed(build_config(base).train.device) if own_dist else dist
    record = {"config": base, "space": space.to_dict(), "trials": n_trials, "config_file": str(config)}
    legacy = check_objective(space, folder)
    if not legacy:
        record["protocol"] = "validation"
    lock = store = study = None
    try:
        if dist.is_main:
            lock, store, study = open_study(optuna, folder, record, space, rebuild)
            retry_passing_failures(optuna, study)
        started = started_settings(folder) if legacy else {}
        sw = SweepRun(optuna, study, store, space, base, n_trials, folder, dist, started)
        if parallel > 1:
            attach_run_log(folder)
            run_parallel(sw, parallel)
        else:
            run_trials(sw)
        if not dist.is_main:
            return {}
        from cloudml_lib.commands.compare import sweep_summary, write_sweep_report

        write_sweep_report(study, folder, space)
        return sweep_summary(study, space)
    finally:
        if lock is not None:
            lock.release()
        if own_dist:
            dist.close()


def check_objective(space: Space, folder: RunFolder) -> bool:
    """Whether the sweep goes on under CloudML 0.2's protocol (a sweep it started, whose sweep.json records
    no protocol): only such a sweep may keep objective held_out, which chose the best trial on the test
    flights; a new sweep naming it is refused."""
    saved = RunFiles(folder.path).sweep() if (folder.path / "sweep.json").is_file() else None
    legacy = saved is not None and "protocol" not in saved
    if space.objective == LEGACY_OBJECTIVE and not legacy:
        raise ConfigError(
            f"objective: {LEGACY_OBJECTIVE} chose the best trial on the test flights (CloudML 0.2); it is "
            "kept "
            "for sweeps started then to continue. Use objective: validation (each trial's validation data) "
            "or crossval; the best trial's test score is reported once, beside it."
        )
    if legacy and space.objective == LEGACY_OBJECTIVE:
        log.info(
            "This sweep was started by CloudML 0.2 (objective held_out): it continues under its protocol, "
            "its "
            "trials choosing on their test flights; its report says so."
        )
    return legacy


def started_settings(folder: RunFolder) -> dict:
    """The settings a sweep started by CloudML 0.2 keeps in its new trials: those its first trial's stored
    config lacks, with the meaning they had then (absent_settings: its protocol, choosing on the test
    flights, among them); that protocol alone where no trial got as far as storing its config."""
    configs = sorted(folder.path.glob("trials/*/config.yaml")) + sorted(
        folder.path.glob("trials/*/folds/*/model/config.yaml")
    )
    for path in configs:
        config = RunFiles(path.parent).config()
        if config is not None:
            return absent_settings(config)
    return {"data.validation": LEGACY_VALIDATION}


def check_trials(n_trials, space: Space) -> None:
    """--trials: a whole number >= 1 whose trials' sampler seeds (seed + number) stay valid seeds."""
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"--trials {shown(n_trials)}: expected a whole number of trials >= 1")
    if n_trials > MAX_SEED + 1:  # no seed lets them all draw: a count no sweep can reach
        raise ConfigError(
            f"--trials {shown(n_trials, 40)}: more trials than a sweep can run (each draws with its own "
            f"seed, at most {MAX_SEED + 1:,} of them); a sweep of 8 to 50 trials is usual, and --trials "
            "can be raised later to add more"
        )
    if space.seed + n_trials - 1 > MAX_SEED:
        raise ConfigError(
            f"seed {space.seed} with --trials {n_trials}: trial n draws with seed + n, which must stay "
            f"at most {MAX_SEED}; choose seed <= {max(0, MAX_SEED - n_trials + 1)} in the space file"
        )


def open_study(optuna, folder: RunFolder, record: dict, space: Space, rebuild: bool = False) -> tuple:
    """Rank 0: the sweep folder checked and locked, sweep.json written, the study restored (or created) from
    its journal, or rebuilt from the trial folders when asked (`rebuild`). Returns (lock, journal, study)."""
    check_sweep_folder(folder, record)
    claim(folder.path, SWEEP)  # made (or adopted) and marked before anything is written into it
    lock = RunLock(folder)
    lock.acquire()
    try:
        write_text(folder.path / "sweep.json", json.dumps(json_safe(record), indent=1))
        store = StudyFile(folder)
        folders = list(sweep_trials(folder).values())  # the sweep's own: a stray folder is not a trial
        if rebuild:
            study = rebuild_study(optuna, store, folder, space)
        else:
            problem = store.restore(has_trials=bool(folders))
            study = None if problem else load_study(optuna, store, space)
            problem = problem or behind_folders(study, folders)
            if problem:
                raise CloudMLError(lost_study_message(problem, folder, len(folders)))
        store.save()
    except BaseException:
        lock.release()
        raise
    return lock, store, study


def trial_kind(space: Space) -> Kind:
    """A trial's folder is a run, or a cross-validation where the objective is one."""
    return CROSSVAL if space.objective == "crossval" else RUN


def run_trials(sw: SweepRun) -> None:
    """Trial after trial until all are done: rank 0 asks (or takes back a trial left running), every process
    trains it, rank 0 tells its result and rewrites the report."""
    from cloudml_lib.commands.compare import write_sweep_report

    while True:
        trial = job = None
        if sw.dist.is_main:
            attach_run_log(sw.folder)
            trial = next_trial(sw.optuna, sw.study, sw.space, sw.n_trials)
            job = None if trial is None else (trial.number, suggest(trial, sw.space))
            sw.store.save()  # the trial and its values, before any training
        job = sw.dist.from_main(job)
        if job is None:
            return
        number, params = job
        say_trial(number, sw.n_trials, params)
        result = run_trial(sw, trial, number, params)
        if sw.dist.is_main:
            attach_run_log(sw.folder)
            finish_trial(sw, trial, result, params)
            sw.store.save()
            write_sweep_report(sw.study, sw.folder, sw.space)


def run_parallel(sw: SweepRun, n: int) -> None:
    """`--parallel n`: n trials at once, one worker process each (trialpool.py). This process stays the
    sweep's one owner: it asks for each trial (or takes back one left running that no worker holds), tells
    each result, writes trial.json's end, the study's copy (every IDLE_EVERY_S and after each result) and the
    report; the workers only train, each trial as run_trial does, reporting its epochs to the shared
    journal (Optuna's file lock makes several writers safe on one machine)."""
    from cloudml_lib.commands.compare import write_sweep_report

    n = min(n, trials_to_run(sw))
    if n < 1:
        return  # every trial is done: no worker to start
    setup = WorkerSetup(sw.folder, sw.store.local, sw.space.to_dict(), sw.base, sw.n_trials, sw.started)
    held: dict[int, tuple] = {}  # trial number -> (trial, values): given to a worker, not yet told
    with Workers(n, build_config(sw.base).train.device, "trials", trial_worker, (setup,)) as workers:
        while True:
            while len(held) < n and (trial := next_trial(sw.optuna, sw.study, sw.space, sw.n_trials, held)):
                params = suggest(trial, sw.space)
                held[trial.number] = (trial, params)
                sw.store.save()  # the trial and its values, before any training
                say_trial(trial.number, sw.n_trials, params)
                build_caches(sw, trial.number, params)
                workers.put(trial.number, (trial._trial_id, trial.number, params))
            if not held:
                break
            number, result = workers.next_result(idle=sw.store.save)
            trial, params = held.pop(number)
            attach_run_log(sw.folder)
            finish_trial(sw, trial, result, params)
            sw.store.save()
            write_sweep_report(sw.study, sw.folder, sw.space)
        workers.close()


def trials_to_run(sw: SweepRun) -> int:
    """The trials still to run: those never asked, those left running by a kill and those queued to be
    trained again."""
    states = (sw.optuna.trial.TrialState.RUNNING, sw.optuna.trial.TrialState.WAITING)
    unfinished = sw.study.get_trials(deepcopy=False, states=states)
    return max(0, sw.n_trials - len(counted(sw.optuna, sw.study))) + len(unfinished)


def build_caches(sw: SweepRun, number: int, params: dict) -> None:
    """A trial's preprocessing caches, opened (built if missing) by the owner before a worker opens them: a
    cache has no lock of its own, and two workers building one flight's cache at once (the first trials on
    a new machine, or values that change the frames) would trip over each other's files."""
    from cloudml_lib.data.cache import load_caches
    from cloudml_lib.data.flights import resolve_config

    try:
        cfg = build_config(trial_raw(sw.base, params), source=f"trial {number}'s config")
        cfg = derive(cfg, sw.started) if sw.started else cfg
        load_caches(resolve_config(cfg, check_names=False)[0].data)
    except CloudMLError:
        pass  # the worker meets it again and fails the trial with it, as a serial sweep does


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker rebuilds its side of the sweep from (picklable: no Optuna objects)."""

    folder: RunFolder
    journal: Path  # the study's local journal, shared by the sweep's processes
    space: dict
    base: dict
    n_trials: int
    started: dict


def trial_worker(place, jobs, results, setup: WorkerSetup) -> None:
    """A worker process of a parallel sweep: trial after trial, each job (trial id, number, values)."""
    serve(place, jobs, results, lambda: _trial_runner(setup))


def _trial_runner(setup: WorkerSetup):
    """This worker's view of the sweep (the study from the shared journal, one process, no copy to write)
    and the function that runs one of its trials."""
    optuna = require_optuna()
    space = Space(**setup.space)
    store = StudyFile(setup.folder)
    store.local = Path(setup.journal)  # the owner's, whatever this process's temporary folder is
    study = optuna.load_study(
        study_name=STUDY_NAME, storage=store.storage(optuna), pruner=make_pruner(optuna, space)
    )
    sw = SweepRun(optuna, study, None, space, setup.base, setup.n_trials, setup.folder, SINGLE, setup.started)

    def run(job: tuple) -> tuple:
        trial_id, number, params = job
        study.sampler = make_sampler(optuna, space, number)  # as the owner drew it
        return run_trial(sw, optuna.trial.Trial(study, trial_id), number, params)

    return run


def say_trial(number: int, n_trials: int, params: dict) -> None:
    where = f"{number + 1} of {n_trials}" if number < n_trials else "an earlier trial's values, trained again"
    log.info("Trial %d (%s): %s", number, where, ", ".join(f"{k}={v}" for k, v in params.items()))


def finish_trial(sw: SweepRun, trial, result: tuple, params: dict) -> None:
    """Tell the study the trial's (state, value, note), write trial.json, and say it."""
    optuna, study, space, folder = sw.optuna, sw.study, sw.space, sw.folder
    state, value, note = result
    states = {
        "complete": optuna.trial.TrialState.COMPLETE,
        "pruned": optuna.trial.TrialState.PRUNED,
        "failed": optuna.trial.TrialState.FAIL,
    }
    if note:
        trial.set_user_attr("note", note)
    study.tell(trial, value if state == "complete" else None, state=states[state])
    trial_dir = claim(folder.path / "trials" / str(trial.number), trial_kind(space))
    write_text(
        RunFolder(trial_dir).trial,
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
