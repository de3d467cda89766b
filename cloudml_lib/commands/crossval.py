"""Leave-one-flight-out cross-validation with baselines: the honest answer to "does the image model
beat simple models on a flight it has never seen?".

Each flight is the test flight of one fold, and nothing is chosen on it: the cross-validation is nested, each
fold choosing its best epoch and calibrating its intervals on validation data drawn from its own training
flights by the config's rule (data.validation; data/splits.py). A fold is a full, resumable run in
`RUN_DIR/folds/<flight>/model` with its own scalers (fitted on that fold's training part only), so an
interrupted cross-validation continues with its unfinished fold and a finished fold is not trained again. A
cross-validation started by CloudML 0.2 (whose folds chose on their test flight) continues under that
protocol, and its results say so.
Beside the model, every fold scores the baselines of its end (science/baselines.py, fitted on the fold's
training part alone):
- `mean`: the training flights' mean height (the baseline every report carries);
- `linear`, `trees`: a ridge regression and gradient-boosted trees on the labelled frame's raw brightness
  statistics (in the units the IR file states) plus the angles: what the physics sees;
- with ERA5 files beside the flights (read for the baselines whatever data.atmosphere says): `physical` (the
  lifting condensation level of the surface air, no fitted parameter), `cold_top` (the top from the coldest
  pixels in kelvin, the 2 m air and a lapse rate, less a typical thickness), `atmosphere_trees` (the trees on
  the atmosphere alone) and `atmosphere_brightness_trees` (on the atmosphere and the brightness together);
  without them, one line says why they could not be fitted;
- `scalars_only`: a control, the same network trained on its scalar inputs alone (the sun's angles, and with
  data.radiometry the brightness statistics), no frames (`folds/<flight>/scalars_only`).
Each fold names its best baseline and the network's MAE skill against it, and the verdicts say on how many
test flights the frames add nothing to the atmosphere (the best model that reads them, the network or a
baseline on their brightness, against the best on the atmosphere alone). A fold finished by an earlier
release (whose `trees` saw the per-frame reading of the frames, not the temperature, or that had no baseline
on the atmosphere) gets its baselines fitted again, so that one table compares the same baselines on every
fold.
Cloud / no-cloud is scored per fold against its two baselines (`clouds.py`: the majority class and a
brightness-temperature threshold, both fitted on the fold's training flights). Prediction intervals
are measured where they matter, on flights never seen (`intervals.py`): for each test flight,
each method is calibrated on the other folds' test residuals and its coverage and width measured
on this flight; the method that falls least short of the target is chosen for each flight on the
other flights alone (the coverage to quote: nothing on that flight chose it) and on all flights for the
calibrations written: `intervals.json` (all
folds' residuals) calibrates `predict --calibration RUN_DIR`, and each fold's model gets its own
(from the other folds). Warnings that would have saved the users weeks: predictions collapsing
towards a constant (std(pred)/std(true) below 0.3), no better than the mean baseline, a test
flight whose heights lie outside the training flights' range, and intervals that cover far less
than their target on some flight. Every fold is shown with its MAE's bootstrap interval over time blocks; a
fold whose R2 is undefined (its labels do not vary) is named, and the mean R2 says over how many folds it is.
Results: `crossval.json` and `crossval.md`.

On several GPUs, `torchrun --nproc_per_node N -m cloudml_lib crossval ...` trains one fold per
process (fold i on process i mod N, each on its own GPU): simpler and faster than DDP for runs this
small. Rank 0 builds any missing cache first and writes the summary once every fold is done.
"""

from __future__ import annotations

import csv
import json
import logging
from datetime import timedelta
from pathlib import Path

import numpy as np

from cloudml_lib.base import ledger
from cloudml_lib.base.config import LEGACY_VALIDATION, Config, absent_settings, derive
from cloudml_lib.base.errors import CloudMLError, ConfigError, DataError
from cloudml_lib.base.outputs import json_safe, target, write_text
from cloudml_lib.base.ownership import claim
from cloudml_lib.commands.runs import train_run, with_demo_flights
from cloudml_lib.commands.trialpool import Workers, check_parallel, serve
from cloudml_lib.core.machine.distributed import SINGLE, init_distributed
from cloudml_lib.core.network.metrics import regression_metrics
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import CROSSVAL
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.dataset import prepare_data
from cloudml_lib.data.flights import campaign_groups, resolve_config
from cloudml_lib.science import baselines, intervals
from cloudml_lib.science.clouds import BASELINES
from cloudml_lib.science.report import baseline_beats, frames_words, shortcomings, write_report

log = logging.getLogger(__name__)

COMPARED = ("model", "mean", "scalars_only", *baselines.BASELINES[1:])
# each method in the fold table's columns; the first five always shown, the others where a fold has them
COLUMNS = {
    "model": "model",
    "mean": "mean",
    "scalars_only": "scalars only",
    "linear": "linear",
    "trees": "trees",
    "physical": "LCL",
    "cold_top": "cold top",
    "atmosphere_trees": "trees on atmosphere",
    "atmosphere_brightness_trees": "trees on atmosphere + brightness",
}
# what the verdicts call each method the image model is weighed against, in the order they are said
BEATEN = {
    "mean": "the training mean",
    "linear": "the linear model on brightness statistics",
    "trees": "the gradient-boosted trees on brightness statistics",
    "physical": "the lifting condensation level (physical, no fitted parameter)",
    "cold_top": "the cold-top retrieval (physical, no fitted parameter)",
    "atmosphere_trees": "the gradient-boosted trees on the atmosphere",
    "atmosphere_brightness_trees": "the gradient-boosted trees on the atmosphere and brightness statistics",
    "scalars_only": "the scalars-only control",
}
OUT_OF_RANGE_SHARE = 0.1  # test heights outside the training range above this share: warn


def fold_config(cfg: Config, held: str, scalars_only: bool = False, started: dict | None = None) -> Config:
    """The run of one fold (a derived config): `held` names it, its only test flight, or with data.fold_by
    campaign the campaign whose flights it tests (fold_groups); its validation data come from the other
    flights by the config's rule (named validation flights: those left, or auto where none is).
    `started`: the settings a cross-validation started by an earlier release keeps in every fold
    (started_settings; CloudML 0.2's protocol among them: chosen on the test flight)."""
    tested = fold_groups(cfg)[held] if cfg.data.fold_by == "campaign" else [held]
    validation = cfg.data.validation
    if isinstance(validation, list):
        validation = [n for n in validation if n not in tested] or "auto"
    changes = {
        "data.validation": validation,
        **(started or {}),
        "data.test_flights": tested,
        "model.scalars_only": scalars_only,
    }
    if cfg.data.overweight_flight in tested:
        changes["data.overweight_flight"] = ""  # a test flight of this fold; weighted in the others
    if cfg.train.pretrain_flight in tested:
        changes["train.pretrain_flight"] = ""  # a test flight: this fold trains in one phase
    return derive(cfg, changes)


def fold_groups(cfg: Config) -> dict[str, list[str]]:
    """Each fold's name and its test flights: every flight alone (data.fold_by flight), or each campaign's
    flights together (campaign: data/flights.py's campaign_groups); a ConfigError with fewer than two."""
    if cfg.data.fold_by != "campaign":
        return {f.name: [f.name] for f in cfg.data.flights}
    groups = campaign_groups(cfg.data)
    if len(groups) < 2:
        raise ConfigError(
            f"data.fold_by campaign: the flights form {len(groups)} campaign(s) "
            f"({'; '.join(f'{c}: {len(f)} flights' for c, f in groups.items()) or 'none'}); holding one out "
            "needs at least two. Use data.fold_by: flight, or state the grouping in data.campaigns"
        )
    return groups


def fold_baselines(cfg: Config, model_metrics: dict, data) -> dict:
    """The baselines of one fold (`data`: its prepare_data), fitted on its training part: each one's metrics
    on the test flight, those left out with the reason, and the best with the network's skill against it
    (`model_metrics`: the network's)."""
    has = data.test_set.has_height()
    true_km = data.test_set.targets_km()[has]
    fitted = baselines.fit_predict(data.train_set, [data.test_set], cfg.train.seed, cfg.data)
    out = {k: regression_metrics(true_km, v[0][has]) for k, v in fitted.heights.items() if k != "mean"}
    maes = {k: m["mae_km"] for k, m in out.items()}
    best = best_of(model_metrics, {**maes, "mean": None})
    return {**out, "left_out": fitted.left_out, "best_baseline": best}


def best_of(model: dict, maes: dict) -> dict | None:
    """The baseline of lowest MAE among `maes` (name -> MAE; None: taken from the fold's `mean`) with the
    network's MAE skill against it and each (baselines.skill)."""
    known = {k: v for k, v in maes.items() if v is not None and np.isfinite(v)}
    mine = model.get("mae_km")
    if not known or mine is None or not np.isfinite(mine):
        return None
    name = min(known, key=lambda k: (known[k], baselines.BASELINES.index(k)))
    return {
        "name": name,
        "mae_km": known[name],
        "model_mae_km": mine,
        "skill": baselines.skill(mine, known[name]),
        "skill_against": {k: baselines.skill(mine, v) for k, v in known.items()},
    }


def fold_warnings(flight: str, result: dict, train_km: np.ndarray, val_km: np.ndarray) -> list[str]:
    """The fold's model judged by the evaluation's rules (report.shortcomings, and a brightness baseline
    that does as well: report.baseline_beats), and its test heights against the training flights' range."""
    out = [f"{flight}: {w}" for w in shortcomings(result["model"], result["mean"])]
    beaten = baseline_beats(result.get("best_baseline"))
    out += [f"{flight}: {beaten}"] if beaten else []
    outside = float(((val_km < train_km.min()) | (val_km > train_km.max())).mean()) if len(val_km) else 0.0
    if outside > OUT_OF_RANGE_SHARE:
        out.append(
            f"{flight}: {outside:.0%} of its heights lie outside the training flights' range "
            f"{train_km.min():.2f}..{train_km.max():.2f} km"
        )
    return out


def fold_words(groups: dict[str, list[str]]) -> str:
    """The folds in words: each flight the test flight once, or each campaign's flights held out together."""
    if all([name] == flights for name, flights in groups.items()):
        return f"over {len(groups)} flights, each the test flight once: {', '.join(groups)}"
    return (
        f"over {len(groups)} campaigns, each held out with all its flights (validation from the others): "
        + "; ".join(f"{name} ({', '.join(flights)})" for name, flights in groups.items())
    )


def run_fold(cfg: Config, folder: RunFolder, held: str, controls: bool, started: dict | None = None) -> dict:
    fold_dir = folder.path / "folds" / held
    model_cfg = fold_config(cfg, held, started=started)
    if model_cfg.data.test_flights == [held]:
        log.info("Fold %s: %s is the test flight; training and validating on the other flights", held, held)
    else:
        log.info(
            "Fold %s: its flights %s are the test flights; training and validating on the other campaigns",
            held,
            ", ".join(model_cfg.data.test_flights),
        )
    report = train_run(model_cfg, RunFolder(fold_dir / "model"), dist=SINGLE)  # one process per fold
    result = {"model": report["overall"], "mean": report["baseline"]}
    if controls:
        control = train_run(
            fold_config(cfg, held, scalars_only=True, started=started),
            RunFolder(fold_dir / "scalars_only"),
            dist=SINGLE,
        )
        result["scalars_only"] = control["overall"]
    data = prepare_data(model_cfg)
    train_km, test_km = (d.targets_km()[d.has_height()] for d in (data.train_set, data.test_set))
    result.update(fold_baselines(model_cfg, result["model"], data))
    result["best_baseline"] = best_of(
        result["model"], {k: (result.get(k) or {}).get("mae_km") for k in baselines.BASELINES}
    )
    result["cloud"] = report.get("cloud")
    tested = model_cfg.data.test_flights
    result["mae_interval_km"] = (report.get("mae_interval_km") or {}).get(held) if tested == [held] else None
    result["protocol"] = (report.get("protocol") or {}).get("name", LEGACY_VALIDATION)
    if report.get("validation"):
        result["validation"] = report["validation"]["pooled"]
    result["warnings"] = fold_warnings(held, result, train_km, test_km)
    for flight in tested:  # the domain check: a test flight unlike the training flights
        inputs = ((report.get("inputs") or {}).get("per_flight") or {}).get(flight)
        if inputs and inputs.get("outside"):
            result["warnings"].append(f"Fold {held}: {inputs['words']}.")
    write_text(fold_dir / "fold.json", json.dumps(json_safe(result), indent=1))
    return result


def run_folds(
    cfg: Config, folder: RunFolder, names: list[str], controls: bool, started: dict, parallel: int
) -> dict:
    """The folds `names`, one after another, or `parallel` at once, one worker process each (their caches
    built here first: a cache has no lock of its own, and two workers must not build one at once)."""
    if parallel <= 1:
        return {name: run_fold(cfg, folder, name, controls, started) for name in names}
    load_caches(cfg.data)
    done = {}
    with Workers(parallel, cfg.train.device, "folds", fold_worker, (cfg, folder, controls, started)) as w:
        for name in names:
            w.put(name, name)
        while len(done) < len(names):
            name, result = w.next_result(idle=lambda: None)
            done[name] = result
        w.close()
    return {name: done[name] for name in names}


def fold_worker(place, jobs, results, cfg: Config, folder: RunFolder, controls: bool, started: dict) -> None:
    """A worker process of a parallel cross-validation: fold after fold, each job its test flight's name."""
    serve(place, jobs, results, lambda: lambda held: run_fold(cfg, folder, held, controls, started))


def read_fold(folder: RunFolder, held: str) -> dict:
    """A fold another process trained: its fold.json, checked."""
    from cloudml_lib.base.runfiles import RunFiles

    files = RunFiles(folder.path / "folds" / held)
    result = files.fold()
    if result is None:
        raise DataError(
            f"{files.damaged[0] if files.damaged else f'no fold.json in {files.folder}'}: run the same "
            "crossval command again; the fold is scored again from its finished model"
        )
    return result


def with_baselines(cfg: Config, held: str, result: dict, started: dict | None) -> dict:
    """A fold scored by an earlier release (no `linear` baseline, its `trees` having seen the per-frame
    reading of the frames; or no record of the atmosphere's baselines, `left_out`) with today's baselines
    fitted on its training part, so that every fold compares the same."""
    if "linear" in result and "left_out" in result:
        return result
    log.info("Fold %s was scored by an earlier CloudML: its baselines are fitted again", held)
    data = prepare_data(fold_config(cfg, held, started=started))
    fitted = fold_baselines(cfg, result["model"], data)
    result = {k: v for k, v in result.items() if k not in baselines.BASELINES[1:]}
    maes = {k: (r or {}).get("mae_km") for k, r in {**result, **fitted}.items() if k in baselines.BASELINES}
    return {**result, **fitted, "best_baseline": best_of(result["model"], maes)}


def summarise(folds: dict) -> dict:
    """Mean and spread (std over folds) of each metric of each method, the folds where a metric is undefined
    (named: a fold whose labels do not vary has no R2, and the mean is over the others), and the plain
    verdicts."""
    summary, undefined = {}, {}
    for method in COMPARED:
        named = {n: f[method] for n, f in folds.items() if method in f}
        if named:
            summary[method] = {}
            for k in ("r2", "mae_km", "rmse_km", "bias_km", "std_ratio"):
                values = [r.get(k) for r in named.values()]
                gone = [n for n, v in zip(named, values) if v is None or not np.isfinite(v)]
                if gone:
                    undefined.setdefault(k, {})[method] = gone
                summary[method][k] = {"mean": _nanmean(values), "std": _nanstd(values)}
    cloud = [f["cloud"] for f in folds.values() if f.get("cloud")]
    for method in ("model", *BASELINES):
        rows = [c[method]["overall"] for c in cloud if method in c]
        if rows:
            summary[f"cloud_{method}"] = {
                k: {"mean": _nanmean([r[k] for r in rows]), "std": _nanstd([r[k] for r in rows])}
                for k in ("accuracy", "f1", "roc_auc")
            }
    verdicts = [
        f"R2 is undefined on {', '.join(gone)} (its labels do not vary): the mean R2 of the model is over "
        "the "
        f"other {len(folds) - len(gone)} of {len(folds)} folds."
        for gone in [(undefined.get("r2") or {}).get("model")]
        if gone
    ]
    pairs = [
        (c["model"]["overall"]["accuracy"], c["bt_threshold"]["overall"]["accuracy"])
        for c in cloud
        if "model" in c
    ]
    if pairs:
        wins = sum(a > b for a, b in pairs)
        verdicts.append(
            f"The cloud output beats the brightness-temperature threshold on {wins} of {len(pairs)} "
            "test flights (accuracy)."
            + ("" if wins == len(pairs) else f" It does NOT beat it on {len(pairs) - wins}.")
        )
    for method, words in BEATEN.items():
        pairs = [(f["model"]["mae_km"], f[method]["mae_km"]) for f in folds.values() if method in f]
        if pairs:
            wins = sum(a < b for a, b in pairs)
            verdicts.append(
                f"The image model beats {words} on {wins} of {len(pairs)} test flights (MAE)."
                + ("" if wins == len(pairs) else f" It does NOT beat it on {len(pairs) - wins}.")
            )
    verdicts += skill_verdict(folds, summary) + atmosphere_verdict(folds)
    return {"summary": summary, "verdicts": verdicts, "undefined": undefined}


def atmosphere_verdict(folds: dict) -> list[str]:
    """Whether the frames add anything to the atmosphere, test flight by test flight (report.frames_words), or
    the one line that says why the atmosphere baselines could not be fitted ([] for folds of a release
    before them)."""
    per = {
        n: baselines.beyond_atmosphere(
            f["model"].get("mae_km"), {k: (f.get(k) or {}).get("mae_km") for k in baselines.BASELINES}
        )
        for n, f in folds.items()
    }
    said = frames_words(per)
    if said:
        return [said]
    left_out = [f.get("left_out") or {} for f in folds.values()]
    why = sorted({v for out in left_out for k, v in out.items() if k in baselines.ATMOSPHERE_ONLY})
    return [f"The atmosphere baselines could not be fitted: {'; '.join(why)}."] if why else []


def skill_verdict(folds: dict, summary: dict) -> list[str]:
    """The network's MAE skill against each fold's best baseline, on average (into `summary`) and in words,
    naming the folds where a baseline does at least as well."""
    best = {n: f["best_baseline"] for n, f in folds.items() if f.get("best_baseline")}
    skills = [b["skill"] for b in best.values() if b.get("skill") is not None]
    if not skills:
        return []
    summary["skill_vs_best_baseline"] = {"mean": _nanmean(skills), "std": _nanstd(skills)}
    lost = [n for n, b in best.items() if b.get("skill") is not None and b["skill"] <= 0]
    return [
        f"Against the best baseline of each test flight the network's MAE skill is {_nanmean(skills):+.2f} "
        "on average (1 - MAE network / MAE baseline; above 0 it adds something)"
        + (
            f"; the baseline does at least as well on {', '.join(lost)} ("
            + ", ".join(f"{n}: {baselines.SHORT[best[n]['name']]}" for n in lost)
            + "): there the network adds nothing yet."
            if lost
            else "."
        )
    ]


def _nanmean(values) -> float | None:
    v = [x for x in values if x is not None and np.isfinite(x)]
    return float(np.mean(v)) if v else None


def _nanstd(values) -> float | None:
    v = [x for x in values if x is not None and np.isfinite(x)]
    return float(np.std(v)) if v else None


def fold_pairs(folder: RunFolder, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(predicted, true) km of the test samples with a height of one fold, from its predictions.csv."""
    pred, true = [], []
    with open(folder.path / "folds" / name / "model" / "predictions.csv", newline="") as f:
        for row in csv.DictReader(f):
            if row["true_km"] and row["pred_km"]:
                pred.append(float(row["pred_km"]))
                true.append(float(row["true_km"]))
    return np.asarray(pred), np.asarray(true)


def interval_step(folder: RunFolder, names: list[str], coverage: float) -> dict:
    """Measure every interval method on flights never seen, choose one, and write the calibrations: the
    cross-validation's (all folds) and each fold model's (the other folds)."""
    by_flight = {name: fold_pairs(folder, name) for name in names}
    result = intervals.leave_one_flight_out(by_flight, coverage)
    if result["chosen"]:
        everything = [np.concatenate(x) for x in zip(*by_flight.values())]
        groups = np.concatenate([[n] * len(v[0]) for n, v in by_flight.items()])
        intervals.save(
            folder,
            intervals.calibrate(
                *everything,
                result["chosen"],
                coverage,
                f"leave-one-flight-out residuals of {len(names)} flights "
                f"(cross-validation {folder.path.name})",
                groups=groups,
            ),
        )
        for name in names:
            others = [np.concatenate(x) for x in zip(*(v for k, v in by_flight.items() if k != name))]
            model = RunFolder(folder.path / "folds" / name / "model")
            cal = intervals.calibrate(
                *others,
                result["chosen"],
                coverage,
                f"the other {len(names) - 1} folds' test flights",
                groups=groups[groups != name],
            )
            # for the fold model's weights its evaluation scored: another best.pt predicts without them
            weights = model.files.evaluation().get("weights_sha256")
            intervals.save(model, cal and dict(cal, weights_sha256=weights) if weights else cal)
    return result


def across_folds(cfg: Config, folder: RunFolder, names: list[str], started: dict, result: dict) -> None:
    """Into `result`: the pooled metrics, the intervals on each flight never seen (interval_step), then each
    test flight's adaptation curve (adaptation_step; after the intervals: its N = 0 keeps each fold's
    calibration from the other folds)."""
    pairs = [fold_pairs(folder, n) for n in names]
    result["pooled"] = regression_metrics(
        np.concatenate([t for _, t in pairs]), np.concatenate([p for p, _ in pairs])
    )
    result["intervals"] = interval_step(folder, names, cfg.train.interval_coverage)
    result["verdicts"] += result["intervals"]["verdicts"]
    if cfg.train.adaptation_labels:
        result["adaptation"] = adaptation_step(cfg, folder, names, started)
        result["verdicts"] += result["adaptation"]["verdicts"]


def fold_adaptation(cfg: Config, folder: RunFolder, held: str, started: dict) -> dict:
    """The adaptation curve (science/adapt.py) of each of one fold's test flights (flight -> record), for the
    fold's trained model with the baselines fitted on the fold's training part; a fold that cannot be adapted
    says why (`error`)."""
    from cloudml_lib.core.run.checkpoint import Key
    from cloudml_lib.data.dataset import CloudDataset, Scalers, flag_range
    from cloudml_lib.science.adapt import curve_words, flight_curve, too_few
    from cloudml_lib.science.evaluate import load_run_model

    model = RunFolder(folder.path / "folds" / held / "model")
    counts = {
        f: (m or {}).get("n") for f, m in ((model.files.evaluation() or {}).get("per_flight") or {}).items()
    }
    short = {f: too_few(n, cfg.train.adaptation_labels) for f, n in counts.items() if isinstance(n, int)}
    if counts and all(short.get(f) for f in counts):  # no flight of the fold can show any N: nothing to load
        return {f: {**r, "words": curve_words(f, r)} for f, r in short.items()}
    try:
        rm = load_run_model(model, command="crossval")
    except CloudMLError as e:
        return {held: {"curve": [], "error": str(e), "words": [f"{held}: no adaptation curve: {e}"]}}
    fold_cfg = derive(rm.cfg, {"train.adaptation_labels": list(cfg.train.adaptation_labels)})
    data = prepare_data(fold_config(cfg, held, started=started))
    scalers, out = Scalers.from_dict(rm.ckpt[Key.SCALERS]), {}
    for cache in data.test_set.caches:  # each test flight of the fold (a campaign's: several)
        flight = CloudDataset(
            [cache], scalers, sun_azimuth=fold_cfg.data.sun_azimuth, cloud=False, flags=flag_range(fold_cfg)
        )
        record, _ = flight_curve(rm.model, fold_cfg, flight, data.train_set, intervals.load(model.path))
        out[cache.name] = {**record, "words": curve_words(cache.name, record)}
    return out


def adaptation_step(cfg: Config, folder: RunFolder, names: list[str], started: dict) -> dict:
    """Every fold's adaptation curve, and per N the mean over the flights that show it of the network's MAE
    and of the best adapted baseline's on the part scored, with how many flights call it better, level or
    worse (science/adapt.py)."""
    per_flight = {f: r for n in names for f, r in fold_adaptation(cfg, folder, n, started).items()}
    summary, verdicts = [], []
    for n in [0, *sorted(set(cfg.train.adaptation_labels))]:
        points = [p for f in per_flight.values() for p in f["curve"] if p["n"] == n]
        if not points:
            continue
        net = _nanmean([p["network"]["mae_km"] for p in points])
        best = _nanmean(
            [(p["baselines"].get(p.get("best_baseline") or "") or {}).get("mae_km") for p in points]
        )
        calls = [((p.get("against_best") or {}).get("call")) for p in points]
        counts = {c: calls.count(c) for c in ("better", "level", "worse")}
        summary.append(
            {"n": n, "flights": len(points), "network_mae_km": net, "best_baseline_mae_km": best, **counts}
        )
    if summary:
        words = "; ".join(
            f"N = {s['n']}: {_num(s['network_mae_km'])} km against {_num(s['best_baseline_mae_km'])} km "
            f"({s['better']} better, {s['level']} level, {s['worse']} worse of {s['flights']})"
            for s in summary
        )
        verdicts.append(
            "Adaptation (the network fine-tuned on each test flight's first N labels, the baselines given "
            "the same N; scored after a gap): mean MAE of the network against the best adapted baseline, "
            f"{words}."
        )
    return {
        "labels": sorted(set(cfg.train.adaptation_labels)),
        "per_flight": per_flight,
        "summary": summary,
        "verdicts": verdicts,
    }


def _num(value) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.3f}"


def format_markdown(result: dict) -> str:
    lines = [
        "# Leave-one-flight-out cross-validation",
        "",
        protocol_words(result.get("protocol")),
        "",
        *([f"Cross-validation {result['held_out']}.", ""] if result.get("fold_by") == "campaign" else []),
        "Each flight is the test flight of one fold; metrics in km on that flight (model: R2, MAE with its "
        "95% "
        "interval over time blocks, RMSE, bias, std(pred)/std(true), n; beside it the R2 and MAE of the "
        'baselines on the same flight). R2 "undefined": the flight\'s labels do not vary.',
        "",
        *_fold_table(result["folds"]),
    ]
    s = result["summary"]
    keys = ("r2", "mae_km", "rmse_km", "bias_km", "std_ratio")
    lines += [
        "",
        "| method | R2 (mean +- spread over folds) | MAE km | RMSE km | bias km | std ratio |",
        "|" + "---|" * 6,
    ]
    undefined = result.get("undefined") or {}
    for method, m in ((k, s[k]) for k in COMPARED if k in s):
        lines.append(
            f"| {method} (mean of folds) | "
            + " | ".join(
                _spread(m[k], (undefined.get(k) or {}).get(method), len(result["folds"])) for k in keys
            )
            + " |"
        )

    if result.get("pooled"):
        p = result["pooled"]
        lines.append(
            "| model, pooled over every fold's test flight (differences between flights count as skill) | "
            + " | ".join(_cell(p, k) for k in keys)
            + " |"
        )
    lines += _cloud_lines(result) + _interval_lines(result.get("intervals"))
    lines += _adaptation_lines(result.get("adaptation"))
    lines += ["", *[f"- {v}" for v in result["verdicts"]]]
    if result["warnings"]:
        lines += ["", "Warnings:", *[f"- {w}" for w in result["warnings"]]]
    return "\n".join(lines) + "\n"


def _adaptation_lines(adaptation: dict | None) -> list[str]:
    """Markdown: each test flight's adaptation curve in words (science/adapt.py)."""
    if not adaptation:
        return []
    lines = [
        "",
        "## Adaptation to each test flight with a few of its labels",
        "",
        "The fold's network (its head) fine-tuned on the flight's first N labels in time, a fixed number of "
        "steps; the baselines given the same N labels (their mean error on them removed); the intervals "
        "calibrated on them by cross-fitting. Scored only on the labels after the largest N's block and a "
        "gap (the e-folding lag of the flight's brightness), the same labels for every N.",
        "",
    ]
    for record in adaptation["per_flight"].values():
        lines += [f"- {w}" if not w.startswith("  ") else f"  - {w.strip()}" for w in record.get("words", [])]
    return lines


def _fold_table(folds: dict) -> list[str]:
    """Markdown: each fold's test flight, the R2 and MAE of the model and of each method (COLUMNS: the first
    five always, the others where a fold has them), the best baseline and the skill against it, and the
    model's RMSE, bias and std ratio."""
    shown = [m for m in COMPARED if m in list(COLUMNS)[:5] or any(m in f for f in folds.values())]
    header = ["test flight", "n", *(f"R2 {COLUMNS[m]}" for m in shown), "MAE model", "MAE model 95%"]
    header += [f"MAE {COLUMNS[m]}" for m in shown[1:]]
    header += ["best baseline", "skill vs it", "RMSE model", "bias model", "std ratio model"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, f in folds.items():
        interval = f.get("mae_interval_km")
        cells = [name, str(f["model"]["n"])] + [_cell(f.get(m), "r2") for m in shown]
        cells += [_cell(f["model"], "mae_km"), f"{interval[0]:.3f}-{interval[1]:.3f}" if interval else "-"]
        cells += [_cell(f.get(m), "mae_km") for m in shown[1:]]
        cells += _best_cells(f.get("best_baseline"))
        cells += [_cell(f["model"], k) for k in ("rmse_km", "bias_km", "std_ratio")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _best_cells(best: dict | None) -> list[str]:
    if not best:
        return ["-", "-"]
    skill = best.get("skill")
    return [baselines.SHORT.get(best["name"], best["name"]), "-" if skill is None else f"{skill:+.2f}"]


def _cell(m: dict | None, k: str) -> str:
    if m is None or k not in m:
        return "-"
    v = m[k]
    return "undefined" if v is None or not np.isfinite(v) else f"{v:.3f}"


def _spread(m: dict, gone: list | None, folds: int) -> str:
    if m.get("mean") is None:
        return "undefined"
    said = f"{m['mean']:.3f} +- {m['std']:.3f}"
    return said + (f" ({folds - len(gone)} of {folds} folds; undefined on {', '.join(gone)})" if gone else "")


def protocol_words(name: str | None) -> str:
    if name == LEGACY_VALIDATION:
        return (
            "Started by CloudML 0.2 and continued under its protocol: each fold chose its best epoch on its "
            "test "
            "flight, so the fold scores are optimistic."
        )
    return (
        "Nested: each fold's test flight is untouched (nothing is chosen on it); its best epoch and "
        "intervals "
        "were chosen on validation data of its own training flights (data.validation)."
    )


def _cloud_lines(result: dict) -> list[str]:
    folds = {n: f["cloud"] for n, f in result["folds"].items() if f.get("cloud")}
    if not folds:
        return []
    num = lambda m, k: "-" if m is None or m.get(k) is None else f"{m[k]:.3f}"  # noqa: E731
    methods = [m for m in ("model", *BASELINES) if any(m in c for c in folds.values())]
    lines = [
        "",
        "Cloud / no-cloud on the test flight (the cloud flag of data.cloud_flag); baselines fitted on the "
        "training flights: majority class, brightness-temperature threshold.",
        "",
        "| test flight | n | cloudy share | "
        + " | ".join(f"{k} {m}" for k in ("accuracy", "F1", "ROC-AUC") for m in methods)
        + " |",
        "|" + "---|" * (3 + 3 * len(methods)),
    ]
    for name, c in folds.items():
        first = c[methods[0]]["overall"]
        lines.append(
            f"| {name} | {first['n']} | {num(first, 'cloud_share')} | "
            + " | ".join(
                num(c.get(m, {}).get("overall"), k) for k in ("accuracy", "f1", "roc_auc") for m in methods
            )
            + " |"
        )
    s = result["summary"]
    lines.append(
        "| mean over folds | | | "
        + " | ".join(
            num({k: (s.get(f"cloud_{m}") or {}).get(k, {}).get("mean")}, k)
            for k in ("accuracy", "f1", "roc_auc")
            for m in methods
        )
        + " |"
    )
    return lines


def _interval_lines(iv: dict | None) -> list[str]:
    if not iv or not iv.get("methods"):
        return []
    methods = list(iv["methods"])
    nested = iv.get("nested") or {}  # absent from a cross-validation.json of CloudML 0.2

    def pct(p: dict) -> str:
        if p.get("coverage") is None:
            return "-"
        return f"{p['coverage']:.0%} / {p['mean_width_km']:.2f}" + (
            f" ({p['method']})" if "method" in p else ""
        )

    lines = [
        "",
        f"Prediction intervals ({iv['coverage']:.0%} target) on each flight never seen, calibrated on the "
        "other flights' test residuals: coverage / mean width km, per method and (last column, the estimate "
        "to quote) with each flight's method chosen on the other flights alone"
        + (f"; chosen on all flights, for predict: {iv['chosen']}" if iv["chosen"] else ""),
        "",
        "| test flight | " + " | ".join(methods) + " | method chosen on the other flights |",
        "|" + "---|" * (2 + len(methods)),
    ]
    for name in dict.fromkeys(n for m in methods for n in iv["methods"][m]["per_flight"]):
        cells = [pct(iv["methods"][m]["per_flight"].get(name, {})) for m in methods]
        cells.append(pct((nested.get("per_flight") or {}).get(name, {})))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    means = [
        {"coverage": iv["methods"][m]["mean_coverage"], "mean_width_km": iv["methods"][m]["mean_width_km"]}
        for m in methods
    ] + [{"coverage": nested.get("mean_coverage"), "mean_width_km": nested.get("mean_width_km")}]
    lines.append("| mean | " + " | ".join(pct(p) for p in means) + " |")
    return lines


def started_settings(folder: RunFolder) -> dict:
    """The settings a cross-validation started by an earlier release keeps in the folds still to run: those
    its first fold's stored config lacks, with the meaning they had then (absent_settings; one started by
    CloudML 0.2 lacks data.validation: its folds chose on their test flight, and the rest continue so). {}
    for a cross-validation started today."""
    from cloudml_lib.base.runfiles import RunFiles

    for model in sorted((folder.path / "folds").glob("*/model")):
        config = RunFiles(model).config()
        if config is not None:
            return absent_settings(config)
    return {}


def crossval(
    cfg: Config, folder: RunFolder | str | Path, controls=True, dist=None, parallel=1, adapt=True
) -> dict:
    """Every fold (resuming an unfinished one, skipping finished ones), then the summary files. `folder`: the
    cross-validation's (a path is taken as one); each fold's model is a RunFolder in it. `dist`: a process
    group the caller owns (a sweep's; left open), else torchrun's own, closed at the end. `parallel`: folds
    trained at once on this machine, one worker process each (trialpool.py). `adapt`: the adaptation curves
    (train.adaptation_labels; a sweep's trials leave them out: they choose nothing)."""
    folder = RunFolder.of(folder)
    folder.check_crossval()
    cfg = with_demo_flights(cfg, SINGLE if dist is None else dist)  # torchrun's group is not up yet
    cfg, _ = resolve_config(cfg, check_names=False)  # each fold names its own test flight
    if len(cfg.data.flights) < 2:
        found = ", ".join(f.name for f in cfg.data.flights) or "none"
        raise ConfigError(f"crossval needs at least two flights; found {found}")
    groups = fold_groups(cfg)
    names = list(groups)
    parallel = check_parallel(parallel, len(names), "folds", "crossval", dist)
    # Under torchrun: the processes only meet twice (caches built, folds done), hours apart at most.
    workers = dist or init_distributed(cfg.train.device, backend="gloo", timeout=timedelta(days=2))
    try:
        if workers.is_main:
            claim(folder.path, CROSSVAL)  # made (or adopted) and marked before any fold writes into it
            ledger.add(folder.path / "folds")  # the folds' folder is CloudML's, with what they write in it
        workers.barrier()
        if workers.active:
            workers.main_first(lambda: load_caches(cfg.data))  # no two processes build one cache
        mine = names[workers.rank :: workers.world]
        started = started_settings(folder)
        # started by CloudML 0.2, or a trial of a sweep it started: its protocol throughout
        legacy = LEGACY_VALIDATION in (started.get("data.validation"), cfg.data.validation)
        log.info("Cross-validation %s", fold_words(groups))  # the notebook's view reads it (colab/live.py)
        if legacy:
            log.info("%s", protocol_words(LEGACY_VALIDATION))
        if workers.active:
            log.info("Process %d of %d: folds %s", workers.rank, workers.world, ", ".join(mine) or "none")
        done = run_folds(cfg, folder, mine, controls, started, parallel)
        workers.barrier()
    finally:
        if dist is None:
            workers.close()
    if not workers.is_main:
        return {}
    folds = {name: done[name] if name in done else read_fold(folder, name) for name in names}
    folds = {name: with_baselines(cfg, name, f, started) for name, f in folds.items()}
    result = {
        "protocol": LEGACY_VALIDATION if legacy else "nested",
        "fold_by": cfg.data.fold_by,
        "held_out": fold_words(groups),
        "folds": folds,
        **summarise(folds),
        "warnings": [w for f in folds.values() for w in f["warnings"]],
    }
    across_folds(
        cfg if adapt else derive(cfg, {"train.adaptation_labels": []}), folder, names, started, result
    )
    folder.path.mkdir(parents=True, exist_ok=True)
    write_text(folder.path / "crossval.json", json.dumps(json_safe(result), indent=1))
    write_text(target(folder.path / "crossval.md"), format_markdown(result))
    write_report(folder)
    log.info("Cross-validation:\n%s", format_markdown(result))
    for w in result["warnings"]:
        log.warning("%s", w)
    return result
