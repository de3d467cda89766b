"""Runs side by side (`python -m cloudml_lib compare DIR...`) and a sweep's report.

A row per run: the settings that differ between the runs compared, the test metrics (a sweep's trials: the
validation metric that chose them), epochs trained, the time of its epochs and whether it was compiled. A
folder may be a run, a cross-validation (its mean over folds) or a sweep (each of its trials). Everything is
read from the files a run writes (config.yaml, evaluation.json, metrics.jsonl, run.json, crossval.json,
trial.json); nothing is loaded into torch.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

from cloudml_lib.base import tables
from cloudml_lib.base.config import LEGACY_VALIDATION, NEW, conv_channels, resume_rules
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.outputs import target, write_text
from cloudml_lib.base.runfiles import RunFiles, numbered_folders
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import flatten_keys, fold_models

log = logging.getLogger(__name__)

# Where the data is and what differs between folds by design: never a "setting that differs".
# where the files live: bookkeeping (the flights a run used, by name, and its test flights are settings)
NOT_SETTINGS = ("data.dir", "data.cache_dir", "data.cache_copy_dir")
# resume rule NEW, but what a run was trained on: the demo's flights or the user's
DATA_SETTINGS = ("data.demo",)
MIN_FOR_IMPORTANCE = 3  # fANOVA over fewer finished trials splits the importance evenly: noise
METRIC_COLUMNS = (("r2", "R2"), ("mae_km", "MAE (km)"), ("rmse_km", "RMSE (km)"), ("bias_km", "bias (km)"))


MAX_EPOCH_S = 7 * 86400.0  # an epoch's time beyond a week is not a time this kit measured


def epoch_seconds(record: dict) -> float:
    t = record.get("time_s")
    return t if isinstance(t, (int, float)) and 0 <= t <= MAX_EPOCH_S else 0.0


def own_epochs(records: list[dict], planned: int | None) -> tuple[list[dict], str]:
    """The run's epoch records (the last of each epoch number, within the planned epochs), and a note on
    what was left out: records past the planned end or with a time no run takes (metrics.jsonl edited or
    appended to by something else)."""
    by_epoch: dict[int, dict] = {}
    past = 0
    for r in records:
        if r["kind"] != "epoch" or not isinstance(r.get("epoch"), int):
            continue
        if r["epoch"] < 1 or (planned is not None and r["epoch"] > planned):
            past += 1
        else:
            by_epoch[r["epoch"]] = r
    kept = [by_epoch[k] for k in sorted(by_epoch)]
    odd_times = sum(1 for r in kept if r.get("time_s") is not None and not epoch_seconds(r))
    notes = []
    if past:
        notes.append(
            f"metrics.jsonl: {past} epoch record(s) outside epochs 1-{planned or '...'}, not counted"
        )
    if odd_times:
        notes.append(f"metrics.jsonl: {odd_times} epoch time(s) not counted (not 0 to {MAX_EPOCH_S:g} s)")
    return kept, "; ".join(notes)


def run_row(run: RunFolder, name: str, scores: str = "test") -> dict:
    """One training run (or a sweep trial's run); its damaged files named in "damaged". `scores`: which of
    its numbers the row shows: the test flights' (pooled where there are several: run_rows adds a row per
    flight) or, for a sweep's trial, the validation data's that chose it."""
    files = RunFiles(run.path)
    config, records = files.config(), files.metrics()
    planned = ((config or {}).get("train") or {}).get("epochs")
    epochs, odd = own_epochs(records, planned if isinstance(planned, int) else None)
    trial = files.trial()
    # a sweep trial's own state (complete, pruned, failed, running), else the run's (status.run_state)
    own = None if trial.get("state") else run.state()
    state = trial.get("state") or ("not started" if own is None or own.kind == "none" else own.words)
    # the test scores of other weights or another step than the run's (its state says which) are not its
    stale = own is not None and own.kind == "trained"
    final = None if stale else next((r for r in records if r["kind"] == "final"), None)
    evaluation = {} if stale else files.evaluation()
    validation = (evaluation.get("validation") or {}).get("pooled")
    overall = (validation if scores == "validation" and validation else evaluation.get("overall")) or final
    scored_on = "validation" if scores == "validation" and validation else held_out(evaluation, config)
    if not overall and epochs:  # no final evaluation (pruned, stopped): the last epoch's scores
        overall, state = epochs[-1], f"{state} (epoch {epochs[-1]['epoch']} scores)"
        # an epoch is scored on the validation data (a run of CloudML 0.2: on its test flights)
        rule = ((config or {}).get("data") or {}).get("validation", LEGACY_VALIDATION)
        scored_on = scored_on if rule == LEGACY_VALIDATION else "validation"
    overall = overall or {}
    compile_info = files.run_info().get("compile") or {}
    return {
        "run": name,
        "config": config,
        "held_out": scored_on,
        "state": "finished" if state == "complete" else state,
        "note": "; ".join(x for x in (trial.get("note"), odd) if x),
        "epochs": f"{len(epochs)}/{planned}" if isinstance(planned, int) else str(len(epochs)),
        "metrics": {k: overall.get(k) for k, _ in METRIC_COLUMNS},
        "n": overall.get("n"),
        "minutes": sum(epoch_seconds(r) for r in epochs) / 60,
        "compiled": ("yes, " + str(compile_info.get("mode"))) if compile_info.get("active") else "no",
        "damaged": files.damaged,
        "per_flight": evaluation.get("per_flight") if scores == "test" else None,
        "skill": best_skill(evaluation, None) if scored_on != "validation" else None,
        "flight_skill": {f: best_skill(evaluation, f) for f in evaluation.get("per_flight") or {}},
        "frames": frames_beyond(evaluation, None) if scored_on != "validation" else None,
        "flight_frames": {f: frames_beyond(evaluation, f) for f in evaluation.get("per_flight") or {}},
    }


def best_skill(evaluation: dict, flight: str | None) -> str | None:
    """ "+0.35 vs linear on brightness": the network's MAE skill against the best baseline of a test flight
    (None: pooled) as its evaluation recorded it; None where it recorded none (written before the physical
    baselines)."""
    from cloudml_lib.science.baselines import SHORT
    from cloudml_lib.science.report import best_baseline

    best = best_baseline(evaluation, flight)
    if best is None or best.get("skill") is None:
        return None
    return f"{best['skill']:+.2f} vs {SHORT.get(best['name'], best['name'])}"


def frames_beyond(evaluation: dict, flight: str | None) -> str | None:
    """ "add +0.35" or "nothing": whether the frames add anything to the atmosphere on a test flight (None:
    pooled), the best model that reads them against the best on the atmosphere alone, as the evaluation
    recorded it (baselines.beyond_atmosphere); None without ERA5 (or written before)."""
    b = (evaluation.get("baselines") or {}).get("beyond_atmosphere") or {}
    v = b.get("pooled") if flight is None else (b.get("per_flight") or {}).get(flight)
    if not isinstance(v, dict) or "frames_add" not in v:
        return None
    skill = v.get("skill")
    return "nothing" if not v["frames_add"] else "add" + ("" if skill is None else f" {skill:+.2f}")


def run_rows(run: RunFolder, name: str) -> list[dict]:
    """A run's rows: each test flight's numbers, then the pooled ones, named so, where it has several test
    flights; one row where it has one."""
    row = run_row(run, name)
    per = row.pop("per_flight") or {}
    skills = row.pop("flight_skill") or {}
    frames = row.pop("flight_frames") or {}
    if len(per) < 2:
        return [row]
    flights = [
        {**row, "run": f"{name}: {f}", "held_out": f, "metrics": {k: m.get(k) for k, _ in METRIC_COLUMNS}}
        | {"n": m.get("n"), "skill": skills.get(f), "frames": frames.get(f)}
        for f, m in per.items()
    ]
    return flights + [{**row, "run": f"{name}: pooled", "held_out": f"pooled over {row['held_out']}"}]


def crossval_row(folder: RunFolder, name: str) -> dict:
    """A cross-validation: the mean over its folds."""
    files = RunFiles(folder.path)
    result = files.crossval()
    folds = fold_models(folder)
    rows = [run_row(RunFolder(f), name) for f in folds]
    first = rows[0] if rows else {"config": None, "compiled": "no"}
    model = result.get("summary", {}).get("model", {})
    skill = (result.get("summary", {}).get("skill_vs_best_baseline") or {}).get("mean")
    # the earlier protocol only where crossval.json says so (read, without a protocol or with CloudML 0.2's);
    # a damaged file says nothing about it, and is named with the damage
    legacy = bool(result) and result.get("protocol") in (None, "test_flights")
    return {
        "run": name,
        "config": first["config"],
        "held_out": ("each campaign once" if result.get("fold_by") == "campaign" else "each flight once")
        + f" ({len(folds)} folds, mean"
        + (", chosen on each test flight: CloudML 0.2)" if legacy else ")"),
        # crossval.json is written when the last fold ends: there, finished (its damage named beside)
        "state": "finished" if (folder.path / "crossval.json").exists() else "stopped (resumable)",
        "note": "",
        "epochs": f"{len(folds)} folds",
        "metrics": {k: (model.get(k) or {}).get("mean") for k, _ in METRIC_COLUMNS},
        "n": sum(r["n"] or 0 for r in rows) or None,
        "minutes": sum(r["minutes"] for r in rows),
        "compiled": first["compiled"],
        "damaged": files.damaged + [d for r in rows for d in r["damaged"]],
        "skill": None if skill is None else f"{skill:+.2f} vs each fold's best (mean)",
        "frames": _folds_frames([r.get("frames") for r in rows]),
    }


def _folds_frames(said: list[str | None]) -> str | None:
    """ "add on 3 of 5 folds": on how many folds the frames add something to the atmosphere (folds without
    ERA5 not counted); None where no fold says."""
    known = [s for s in said if s is not None]
    if not known:
        return None
    return f"add on {sum(s.startswith('add') for s in known)} of {len(known)} folds"


def trial_rows(folder: RunFolder, name: str) -> list[dict]:
    """A row per trial folder (trials/<number>), its state and note from trial.json."""
    rows = []
    legacy = "protocol" not in (RunFiles(folder.path).sweep() or {"protocol": None})
    for trial in numbered_folders(folder.path / "trials"):
        t = RunFolder(trial)
        label = str(Path(name) / "trials" / trial.name)
        row = (
            crossval_row(t, label)
            if t.is_crossval()
            else run_row(t, label, "test" if legacy else "validation")
        )
        row.pop("per_flight", None)
        row.pop("flight_skill", None)
        files = RunFiles(trial)
        info = files.trial()
        row["state"] = {"complete": "finished"}.get(info.get("state"), info.get("state") or row["state"])
        row["note"] = info.get("note") or row["note"]
        row["damaged"] = sorted(set(row["damaged"] + files.damaged))
        rows.append(row)
    return rows


def compare_runs(folders: list[RunFolder | str | Path]) -> list[dict]:
    """A row per run, cross-validation or sweep trial in `folders` (RunFolders; a path is taken as one); a
    folder holding none is refused by name."""
    rows = []
    for f in folders:
        folder = RunFolder.of(f)
        if (folder.path / "sweep.json").exists():
            rows += trial_rows(folder, str(f)) or [empty_sweep_row(folder, str(f))]
        elif folder.is_crossval():
            rows.append(crossval_row(folder, str(f)))
        elif folder.holds_run():
            rows += run_rows(folder, str(f))
        else:
            raise CloudMLError(
                f"{f} holds no run, cross-validation or sweep (no config.yaml, metrics.jsonl, "
                "crossval.json or sweep.json); give folders made by train, crossval or sweep"
            )
    return rows


def empty_sweep_row(folder: RunFolder, name: str) -> dict:
    """A sweep without a trial folder yet: one row that says so (and whether its sweep.json reads)."""
    files = RunFiles(folder.path)
    files.sweep()
    return {
        "run": name,
        "config": None,
        "held_out": "-",
        "state": "no trial started yet",
        "note": "",
        "epochs": "0",
        "metrics": {k: None for k, _ in METRIC_COLUMNS},
        "n": None,
        "minutes": 0.0,
        "compiled": "no",
        "damaged": files.damaged,
    }


def held_out(evaluation: dict, config: dict | None) -> str:
    """The flights a run's metrics were measured on: those its evaluation scored, else its config's; marked
    where the run chose on them (CloudML 0.2's protocol)."""
    flights = sorted(evaluation.get("per_flight") or {})
    if not flights and config:
        data = config.get("data") or {}
        named = data.get("test_flights", data.get("validation_flights"))  # its earlier name
        flights = [str(f) for f in named] if isinstance(named, list) else []
    legacy = bool(evaluation) and (evaluation.get("protocol") or {}).get("name") != "untouched_test"
    return (", ".join(flights) or "?") + (" (chosen on them: CloudML 0.2)" if legacy else "")


def differing_settings(rows: list[dict]) -> list[str]:
    """Config keys whose values differ between the rows (a row whose config.yaml is unreadable has no say).
    Only settings that change what a run computes count (resume rule "must stay the same"): where files
    live, logging, checkpoints, the device and the planned epochs (its own column) are bookkeeping, which
    would push the metrics off the screen in a sweep."""
    flat = [settings_of(r["config"]) for r in rows if r["config"] is not None]
    keys = sorted(set().union(*flat)) if flat else []
    rules = resume_rules()
    return [
        k
        for k in keys
        if not k.startswith(NOT_SETTINGS)
        and (rules.get(k) != NEW or k in DATA_SETTINGS)
        and len({json.dumps(f.get(k)) for f in flat}) > 1
    ]


def settings_of(config: dict) -> dict:
    """A run's settings, flat ("model.channels"), as the run used them: channels left empty (chosen by
    model.memory_optimized) shown as the channels the model has, never as []."""
    flat = flatten_keys(config)
    if isinstance(flat.get("data.flights"), list):  # the flights by name: their files' places are bookkeeping
        flat["data.flights"] = sorted(f.get("name") for f in flat["data.flights"] if isinstance(f, dict))
    if flat.get("model.channels") == []:
        flat["model.channels"] = conv_channels([], bool(flat.get("model.memory_optimized")))
    return flat


def _cell(value) -> str:
    """A setting's cell: a number to 4 significant digits (a learning rate of 0.00207 stays 0.00207)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _metric(value) -> str:
    """A metric's cell, to 3 decimals (1 m in km) in every row, so that a column reads evenly."""
    return "-" if value is None else f"{value:.3f}"


def format_comparison(rows: list[dict]) -> str:
    """The Markdown table: run, the flights its metrics were measured on, the metrics, state, epochs, time,
    compiled, then the settings that differ (last: a sweep's many settings never push the metrics off the
    screen); and a warning when metrics were measured on different flights."""
    keys = differing_settings(rows)
    head = [
        "run",
        "scored on",
        *(label for _, label in METRIC_COLUMNS),
        "n",
        "MAE skill vs best baseline",
        "frames beyond the atmosphere",
        "state",
        "epochs",
        "time (min)",
        "compiled",
        *keys,
    ]
    body = []
    for r in rows:
        flat = settings_of(r["config"]) if r["config"] is not None else None
        cells = [
            r["run"],
            r.get("held_out", "?"),
            *(_metric(r["metrics"][k]) for k, _ in METRIC_COLUMNS),
            "-" if r.get("n") is None else str(r["n"]),
            r.get("skill") or "-",
            r.get("frames") or "-",
            r["state"],
            r["epochs"],
            f"{r['minutes']:.1f}",
            r["compiled"],
            *(_cell(flat.get(k)) if flat is not None else "?" for k in keys),
        ]
        body.append(cells)
    lines = [tables.markdown(head, body)]
    noted = [f"- {r['run']}: {r['note']}" for r in rows if r.get("note")]
    if noted:
        lines.append("\nNotes:\n" + "\n".join(noted))
    scored = {r.get("held_out") for r in rows if any(v is not None for v in r["metrics"].values())}
    if len(scored) > 1:
        lines.append(
            '\nThe metrics were measured on different data (column "scored on"): a flight that is easier or '
            "harder moves R2 and MAE as much as a setting does. Compare rows scored on the same flights, or "
            "cross-validations (every flight the test flight once). A validation score chose its run: it is "
            "no test score."
        )
    if len(rows) > 1 and not keys:
        lines.append("\nNo setting differs between these runs.")
    notes = [f"- {r['run']}: {r['state']}: {r['note']}" for r in rows if r.get("note")]
    damaged = [f"- {d}" for r in rows for d in r.get("damaged", [])]
    lines += (["", "Why:", *notes] if notes else []) + (
        ["", "Could not be read:", *damaged] if damaged else []
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------- a sweep's report


def complete_trials(study) -> list:
    """Trials that ran to the end (a pruned trial carries its last epoch's value, not a result)."""
    import optuna

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))


def metric_words(metric: str) -> str:
    """A metric's name as the tables say it (mae_km: "MAE (km)")."""
    return dict(METRIC_COLUMNS).get(metric, metric)


def best_verdict(trial: RunFolder, space) -> str | None:
    """The best trial's test score, reported once (it was chosen on its validation score; no trial was chosen
    on a test flight), and judged as a run is (science.report.verdict); None where it has none (a
    cross-validation objective: crossval.md holds its folds, or not evaluated)."""
    from cloudml_lib.science.report import protocol_words, verdict, with_verdict

    if space.objective == "crossval":
        return None
    report = RunFiles(trial.path).evaluation()
    said = verdict(with_verdict(report)) if report else None
    if not said:
        return None
    o = report["overall"]
    numbers = ", ".join(f"{label} {_metric(o.get(k))}" for k, label in METRIC_COLUMNS) + f", n {o.get('n')}"
    skill = best_skill(report, None)
    numbers += f", MAE skill {skill} (the best baseline on the test flights)" if skill else ""
    return (
        f"The best trial's test score, reported once: {numbers}. {protocol_words(with_verdict(report))} "
        + said.replace("Verdict:", "Verdict on the best trial:", 1)
    )


def sweep_summary(study, space) -> dict:
    trials = [
        {
            "number": t.number,
            "state": t.state.name.lower(),
            "value": t.value,
            "params": t.params,
            "note": t.user_attrs.get("note", ""),
        }
        for t in study.trials
    ]
    done = complete_trials(study)
    best = None
    if done:
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": b.params}
    return {
        "metric": space.metric,
        "direction": space.direction,
        "objective": space.objective,
        "best": best,
        "trials": trials,
    }


def _optuna_figure(kind: str, study, path: Path, metric: str) -> str | None:
    """Optuna's own plot saved as PNG; None, or the reason it cannot be drawn yet."""
    import optuna
    from optuna.visualization import matplotlib as ovm

    from cloudml_lib.science.plots import save_figure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
        try:
            if kind == "history":
                ax = ovm.plot_optimization_history(study, target_name=metric_words(metric))
                from matplotlib.ticker import FuncFormatter, MaxNLocator

                ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trials 0, 1: never 0.2, 0.4
                # counted from 1 as every line of the notebook and the report does (Optuna's from 0)
                ax.xaxis.set_major_formatter(
                    FuncFormatter(lambda x, _: f"{round(x) + 1}" if x > -0.5 else "")
                )
                ax.set_xlabel("trial (counted from 1; its folder is trials/<trial - 1>)")
            else:
                ax = ovm.plot_param_importances(
                    study,
                    evaluator=optuna.importance.FanovaImportanceEvaluator(seed=0),
                    target_name=metric_words(metric),
                )
        except (ValueError, RuntimeError, ImportError) as e:
            return f"not drawn yet ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
    fig.set_size_inches(7, 4)
    fig.tight_layout()
    save_figure(fig, path)
    return None


def write_sweep_report(study, folder: RunFolder, space) -> Path:
    """report.md: the objective, the best trial, the trials table and Optuna's two plots."""
    summary = sweep_summary(study, space)
    finished = complete_trials(study)
    scored_on = {
        "crossval": "nested folds' validation data (the mean over folds)",
        "validation": "trials' validation data (never a test flight)",
    }.get(space.objective, "test flights (objective held_out: a sweep of CloudML 0.2, chosen on them)")
    lines = [
        f"# Sweep {folder.path.name}",
        "",
        f"Objective: {metric_words(space.metric)} ({space.metric}), "
        f"{'lower' if space.direction == 'minimize' else 'higher'} is better, on the {scored_on}; "
        f"sampler {space.sampler} (seed {space.seed}), pruner {space.pruner}. "
        f"{len(study.trials)} trial(s), {len(finished)} finished, "
        f"{sum(t.state.name == 'PRUNED' for t in study.trials)} pruned.",
        "",
    ]
    if summary["best"]:
        b = summary["best"]
        lines += [
            f"Best: trial {b['number'] + 1} (trials/{b['number']}), {metric_words(space.metric)} "
            f"{b['value']:.4g}, with " + ", ".join(f"{k} = {_cell(v)}" for k, v in b["params"].items()) + ".",
            "",
        ]
        said = best_verdict(RunFolder(folder.path / "trials" / str(b["number"])), space)
        lines += [said, ""] if said else []
    lines += ["## Trials", "", format_comparison(trial_rows(folder, "."))]
    lines += ["", "## Optimisation history", ""]
    reason = _optuna_figure("history", study, folder.plots / "optimization_history.png", space.metric)
    lines.append(reason or "![optimisation history](plots/optimization_history.png)")
    lines += ["", "## Importance of each parameter", ""]
    reason = (
        _optuna_figure("importance", study, folder.plots / "param_importances.png", space.metric)
        if len(finished) >= MIN_FOR_IMPORTANCE
        else f"Not drawn yet: it needs {MIN_FOR_IMPORTANCE} finished trials "
        f"(not pruned), this sweep has {len(finished)}."
    )
    lines.append(reason or "![parameter importances](plots/param_importances.png) (fANOVA, seed 0)")
    return write_text(target(folder.path / "report.md"), "\n".join(lines) + "\n")
