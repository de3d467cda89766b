"""A trained run's best model on its test flights: the one route from best.pt to the report.

`load_run_model` reads best.pt with the config it was trained with; `load_end_data` opens the run's flights by
role (data/splits.py: the part trained on, the validation data, the test flights) with the run's scalers;
`score` runs the model over a set of samples; `test_report` turns the answers on the test flights into the
report: per flight first (skill.py: metrics in km against the training-mean baseline, a bootstrap interval of
each flight's MAE, labels outside the trained heights), then pooled, the verdict per flight, cloud / no-cloud
against its baselines, the intervals' coverage where they were not calibrated, the heights outside the bounds,
and the protocol the run was trained under. The end of a run (finish.py) and `evaluate` of a finished run
both go this way; only the end fits the cloud probe and calibrates the intervals (on validation data), once:
evaluating later uses the stored ones and changes neither.

Every metric set holds r2, mae_km, rmse_km, bias_km (mean of predicted - true), std_ratio
(std(pred) / std(true)) and n (network/metrics.py); report.py says when a model does not beat the baseline.
"""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from cloudml_lib.base.config import LEGACY_VALIDATION, Config, config_from_dict, derive, height_bounds_km
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.outputs import atomic_path, json_safe, write_text
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.machine.device import choose_device, choose_precision
from cloudml_lib.core.machine.distributed import SINGLE
from cloudml_lib.core.network.inference import Evaluator, eval_batch_size, prepare_model
from cloudml_lib.core.network.metrics import Scored, bounds_count
from cloudml_lib.core.network.model import build_model
from cloudml_lib.core.run.checkpoint import BEST_KEYS, Key, load_checkpoint, weights_sha256
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.provenance import trained_backend
from cloudml_lib.data import predictors
from cloudml_lib.data.cache import load_flight_cache
from cloudml_lib.data.dataset import CloudDataset, Scalers, flag_range
from cloudml_lib.data.domain import dataset_inputs, recorded
from cloudml_lib.data.preprocess import FramePool, resolve_backend, resolve_workers
from cloudml_lib.data.splits import Split, choose_split
from cloudml_lib.science import baselines, intervals, plots, skill
from cloudml_lib.science.report import (
    flight_verdicts,
    verdict,
    write_report,
)

log = logging.getLogger(__name__)


@dataclass
class Trained:
    """What best.pt says of the training: the mean height of the labels fitted on (km, the baseline), the best
    epoch, and the span of those labels (km; [] where unknown)."""

    train_mean_km: float
    best_epoch: int
    label_range: list
    domain: dict | None = None  # best.pt's record of the inputs trained on (data/domain.py); None: before it


def test_report(
    cfg: Config, data: EndData, scored: Scored, trained: Trained, calibration: dict | None, validation=None
) -> dict:
    """The report on the test flights (their samples with a height, and every sample for cloud / no-cloud):
    per flight and pooled metrics of the model and of the training-mean baseline with each flight's MAE
    interval, the verdicts, the labels outside the trained heights, cloud / no-cloud against its baselines,
    the intervals' coverage on the flights they were not calibrated on, the predictions outside the bounds a
    cloud base can have (config.height_bounds_km), the validation score of the best model (`validation`: its
    Scored on data.val_set) and the protocol. Six parameters: the run, its data, the answers, and what
    training, calibration and validation left."""
    from cloudml_lib.science.clouds import cloud_report

    test = data.test_set
    has = test.has_height()
    true_km, pred_km, flights = test.targets_km()[has], scored.height_km[has], test.flight_names()[has]
    frames = test.frame_indices()[has]
    report = {
        "protocol": protocol(data.split),
        **skill.height_scores(true_km, pred_km, flights, frames, trained.train_mean_km),
        "train_mean_km": float(trained.train_mean_km),
        "best_epoch": int(trained.best_epoch),
        "training_label_range_km": list(trained.label_range),
        "outside_training_labels": skill.outside_labels(true_km, flights, trained.label_range),
    }
    if cfg.model.scalars_only:  # a control (crossval's scalars_only runs): judged without advice
        report["control"] = "model.scalars_only: the network on its scalar inputs alone, no frames"
    if validation is not None:
        v = data.val_set.has_height()
        report["validation"] = skill.validation_scores(
            data.val_set.targets_km()[v], validation.height_km[v], data.val_set.flight_names()[v]
        )
    fitted = baselines.fit_predict(data.frames, [test], cfg.train.seed, cfg.data)
    predicted = {k: v[0][has] for k, v in fitted.heights.items()}
    predicted["mean"] = np.full(int(has.sum()), float(trained.train_mean_km))  # the report's baseline
    report["baselines"] = baselines.compare_baselines(true_km, pred_km, flights, predicted, fitted.left_out)
    best = (report["baselines"].get("best") or {}).get("per_flight")
    report["against_best"] = skill.against_best(best, true_km, pred_km, flights, frames, predicted)
    report["own_mean_mae_km"] = skill.own_mean_mae(true_km, flights)
    tolerances = cfg.train.tolerances_km
    report["as_papers_report"] = skill.as_papers_report(true_km, pred_km, flights, frames, tolerances)
    report["radiometry"] = radiometry_record(cfg, test)
    report["atmosphere"] = atmosphere_record(cfg, test)
    best = (report["baselines"]["best"] or {}).get("pooled")
    report["by_height"] = skill.by_height(
        true_km,
        pred_km,
        flights,
        trained.label_range,
        None if best is None else (baselines.SHORT[best["name"]], predicted[best["name"]]),
    )
    report["inputs"] = inputs_record(trained.domain, test, scored.height_km)
    report["flight_verdicts"] = flight_verdicts(report)
    report["no_height_label"] = [c.name for c in test.caches if not c.has_height.any()]  # high cloud, say
    report["verdict"] = " ".join(filter(None, [verdict(report), no_height_words(report["no_height_label"])]))
    report["verdict"] = report["verdict"] or None
    report["out_of_bounds"] = bounds_count(pred_km, height_bounds_km(cfg.data))
    train_flags = {"flag": data.frames.cloud_flags(), "p10": data.frames.frame_p10()}
    window = cfg.data.cloud_flag == "base_in_range"
    report["cloud"] = cloud_report(
        test.cloud_flags(), scored.cloud_prob, test.flight_names(), test.frame_p10(), train_flags,
        cfg.model.cloud_threshold, window=window, frames=test.frame_indices(),
    )  # fmt: skip
    if calibration is not None:
        seen = list(data.split.test) if data.split.legacy else calibration.get("flights") or []
        report["intervals"] = skill.interval_scores(true_km, pred_km, flights, calibration, seen)
    return report


def no_height_words(flights: list[str]) -> str | None:
    """The test flights without a height label in the product's range, in words; None where there are none."""
    if not flights:
        return None
    return (
        f"No height label on test flight{'s' * (len(flights) > 1)} {', '.join(flights)}: every cloud base "
        "the lidar measured there lies outside the product's range (data.cbh_min_km..cbh_max_km), so the "
        "height is not scored there; the cloud flag is."
    )


def inputs_record(record, test: CloudDataset, pred_km: np.ndarray) -> dict:
    """The domain check on the test flights' labelled frames (data/domain.py): per flight how many lie
    outside the inputs trained on, in words, and the model's MAE on the heights inside and outside."""
    found, why = recorded(record)
    if found is None:
        return {"checked": False, "why": why}
    judged = found.judge(dataset_inputs(test))
    flights, true_km, has = test.flight_names(), test.targets_km(), test.has_height()
    per = {}
    for name in dict.fromkeys(flights[has]):
        mine = (flights == name) & has  # the heights scored (a sample with a cloud flag alone has none)
        sub = judged.subset(mine)
        err = np.abs(pred_km[mine] - true_km[mine])
        finite = np.isfinite(err)  # not `has`: the loop's mask of every test flight stays as it is
        out, inside = finite & sub.outside, finite & ~sub.outside
        per[str(name)] = {
            "frames": int(mine.sum()),
            "outside": int(sub.outside.sum()),
            "mae_km_outside": float(err[out].mean()) if out.any() else None,
            "mae_km_inside": float(err[inside].mean()) if inside.any() else None,
            "words": found.words(str(name), sub, "labelled heights"),
        }
    return {"checked": True, "threshold": found.threshold, "per_flight": per}


def atmosphere_record(cfg: Config, dataset: CloudDataset) -> dict:
    """What the network saw of the flights' atmosphere (data.atmosphere, and its predictors)."""
    return {
        "network_inputs": cfg.data.atmosphere if dataset.scalers.atmosphere else "none",
        "predictors": list(dataset.scalers.atmosphere or []),
    }


def radiometry_record(cfg: Config, dataset: CloudDataset) -> dict:
    """What the network saw of the frames' radiometry (data.radiometry) and in which units the brightness
    statistics are (as the test flights' IR files state them)."""
    units = {c.name: c.radiometry for c in dataset.caches}
    return {
        "network_inputs": cfg.data.radiometry,
        "units": {name: r.units for name, r in units.items()},
        "words": "; ".join(dict.fromkeys(r.words() for r in units.values())),
    }


def protocol(split: Split) -> dict:
    """How the run's numbers were obtained: its split (splits.Split.record) and the protocol in words."""
    return {
        "name": LEGACY_VALIDATION if split.legacy else "untouched_test",
        "words": split.words(),
        **split.record(),
    }


def write_predictions(path: Path, dataset: CloudDataset, scored: Scored) -> None:
    """One row per sample: flight, frame, true and predicted height (empty where no height label), the CPL
    cloud flag and the predicted cloud probability (empty without a cloud output)."""
    true_km, flags, prob = dataset.targets_km(), dataset.cloud_flags(), scored.cloud_prob
    cell = lambda v: f"{v:.4f}" if np.isfinite(v) else ""  # noqa: E731
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["flight", "frame_index", "true_km", "pred_km", "cpl_cloud", "cloud_probability"])
        for i in range(len(dataset)):
            flight, frame = dataset.identity(i)
            w.writerow(
                [
                    flight,
                    frame,
                    cell(true_km[i]),
                    cell(scored.height_km[i]),
                    int(flags[i]),
                    "" if prob is None else f"{prob[i]:.4f}",
                ]
            )


@dataclass
class RunModel:
    """A finished run's best model, ready to predict: on its device, in eval mode."""

    model: torch.nn.Module
    cfg: Config
    ckpt: dict
    device: torch.device
    autocast: object  # a context-manager factory (mixed precision on a GPU)


def load_run_model(
    run: RunFolder | str | Path,
    data_dir: str | None = None,
    command: str = "evaluate",
    cache_dir: str | None = None,
    channels_last: bool | None = None,
) -> RunModel:
    """best.pt of a run with the config it was trained with (data.dir replaced if the files moved, and
    data.cache_dir if the cache is to be built elsewhere, e.g. a run trained on another machine). Every way
    best.pt can be unusable is a CloudMLError naming it. `channels_last`: force the memory format (default:
    where it was measured to pay, inference.prepare_model). `run`: its folder (a path is taken as one)."""

    run = RunFolder.of(run)
    run.check_run(trains=False, command=command)
    best = run.best
    ckpt = _read_best(best, run, run.holds_run())
    try:
        cfg = config_from_dict(ckpt[Key.CONFIG])
    except CloudMLError as e:
        raise CloudMLError(f"{best}: the config stored in it is not valid for this version: {e}") from None
    if data_dir:  # the flights moved since training
        cfg = derive(cfg, {"data.dir": data_dir})
    if cache_dir:  # the recorded cache folder is not this machine's
        cfg = derive(cfg, {"data.cache_dir": cache_dir})
    cfg = _with_stored_cloud_head(cfg, ckpt[Key.MODEL], best, run)
    model = build_model(cfg, Scalers.from_dict(ckpt[Key.SCALERS]))
    film = ckpt[Key.MODEL].get("film.0.weight") if isinstance(ckpt[Key.MODEL], dict) else None
    if film is not None and film.shape[-1] != model.film[0].in_features:
        if film.shape[-1] == 2:  # the angles as two numbers: CloudML before the azimuth's sine and cosine
            raise CloudMLError(
                f"{best} was trained by an earlier CloudML with 2 angle inputs (this version takes the "
                "zenith angle and the sine and cosine of the sun azimuth); retrain the run with this "
                "version, or use the version that trained it."
            )
        raise CloudMLError(
            f"{best}: its network takes {film.shape[-1]} scalar inputs, but the config stored with it "
            f"(data.radiometry: {cfg.data.radiometry}, data.atmosphere: {cfg.data.atmosphere}) gives "
            f"{model.film[0].in_features}; the file was "
            f"damaged or edited. Run train on {run} again to rewrite it from the checkpoints."
        )
    try:
        model.load_state_dict(ckpt[Key.MODEL])
    except (RuntimeError, TypeError, AttributeError) as e:
        raise CloudMLError(
            f"{best}: its weights do not fit the model its config describes "
            f"({str(e).strip().splitlines()[0][:200]}); the file was damaged or edited. Run train on "
            f"{run} again to rewrite it from the checkpoints."
        ) from None
    device = choose_device(cfg.train.device)
    model.to(device).eval()
    prepare_model(model, device, channels_last)
    return RunModel(model, cfg, ckpt, device, choose_precision(device).autocast(device))


def _read_best(best: Path, run: RunFolder, run_exists: bool) -> dict:
    """best.pt loaded (weights only), with every key evaluating or predicting needs."""
    if not best.is_file():
        if run_exists:
            raise CloudMLError(
                f"{run} has no best.pt yet: it is written when the first epoch ends. Continue "
                f"training (python -m cloudml_lib train ... --run-dir {run}), then run this again."
            )
        raise CloudMLError(f"{run} has no best.pt; train first (python -m cloudml_lib train --run-dir {run})")
    ckpt = load_checkpoint(best)
    missing = [k for k in BEST_KEYS if k not in ckpt]
    if missing:
        raise CloudMLError(
            f"{best} is not a complete best model (no {', '.join(missing)}); it was not written by "
            f"this version of CloudML or was damaged. Run train on {run} again to rewrite it."
        )
    return ckpt


def _with_stored_cloud_head(cfg: Config, weights: dict, best: Path, run: RunFolder) -> Config:
    """The config with the cloud head the weights were made with (an earlier CloudML named it otherwise), and
    a word when the model gives no cloud output."""
    stored = cloud_head_of(weights)
    if stored is not None and stored != cfg.model.cloud_head:
        log.warning(
            "%s holds a model with cloud_head %s (its config says %s: an earlier CloudML); it is used as %s.",
            best,
            stored,
            cfg.model.cloud_head,
            stored,
        )
        cfg = derive(cfg, {"model.cloud_head": stored})
    if stored == "none" or (stored == "probe" and not int(weights["cloud_fitted"])):
        log.warning(
            "%s has no cloud / no-cloud output (%s): heights are given for every frame, with no cloud flag "
            "or probability. %s",
            best,
            "trained without one"
            if stored == "none"
            else "it is fitted when training ends, and this run has not ended",
            "Retrain with model.cloud_head: probe to get them."
            if stored == "none"
            else f"Finish the run (train again on {run}).",
        )
    return cfg


def cloud_head_of(state: dict) -> str | None:
    """The model.cloud_head a model's weights were made with (None: not a state dict of this model)."""
    last = state.get("head.4.weight") if isinstance(state, dict) else None
    if last is None:
        return None
    return "joint" if last.shape[0] == 2 else "probe" if "cloud.weight" in state else "none"


@dataclass
class EndData:
    """A run's flights by role (data/splits.py), with the run's scalers: the test flights (`test_set`), the
    validation data (`val_set`), and every matched frame of the part trained on (`frames`: what the cloud
    probe and the cloud baselines are fitted on)."""

    test_set: CloudDataset
    val_set: CloudDataset
    frames: CloudDataset
    split: Split


def load_end_data(cfg: Config, scalers: Scalers, provenance: dict | None, stored_split=None) -> EndData:
    """The caches of the run's flights, preprocessed as the run was trained (provenance), opened or built, and
    split by the run's rule. `stored_split`: the split its checkpoint recorded (a different one is said)."""
    backend = resolve_backend(cfg.data.preprocess_device, trained_backend(provenance))
    with FramePool(resolve_workers(cfg.data.preprocess_workers)) as pool:
        caches = [load_flight_cache(f, cfg.data, backend, pool) for f in cfg.data.flights]
    if scalers.atmosphere:  # a model that reads the atmosphere: the same predictors, from the flights' files
        caches = predictors.attach(caches, cfg.data, scalers.atmosphere)
    for c in caches:  # a model that reads brightness statistics: in the units it was trained on
        scalers.check_units(c.radiometry.units, f"flight {c.name}")
    split = choose_split(caches, cfg.data)
    if isinstance(stored_split, dict) and stored_split != split.record():
        log.warning(
            "The split of the run's flights differs from the one its training recorded (%s now): the flights "
            "changed since; the numbers below are of today's split.",
            split.words(),
        )
    fit, val, test = split.parts(caches)
    azimuth, head, flags = cfg.data.sun_azimuth, cfg.model.cloud_head, flag_range(cfg)
    scored = dict(sun_azimuth=azimuth, cloud=head != "none", flags=flags)
    return EndData(
        CloudDataset(test, scalers, **scored),
        CloudDataset(val, scalers, **scored),
        CloudDataset(fit, scalers, sun_azimuth=azimuth, cloud=True, flags=flags),
        split,
    )


def score(evaluator: Evaluator, dataset: CloudDataset) -> Scored:
    """The model's answers (km, and the cloud probability) for every sample of `dataset`."""
    out, _ = evaluator.outputs(dataset, np.arange(len(dataset)))
    return Scored.from_outputs(out, dataset.scalers)


def trained_of(ckpt: dict, data: EndData) -> Trained:
    """best.pt's record of the training; the span of the heights trained on from the data where an earlier
    release did not record it."""
    span = ckpt.get(Key.LABEL_RANGE)
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, float) for v in span)):
        km = data.frames.targets_km()[data.frames.has_height()]
        span = [float(km.min()), float(km.max())] if km.size else []
    return Trained(float(ckpt[Key.TRAIN_MEAN_KM]), int(ckpt[Key.EPOCH]), span, ckpt.get(Key.DOMAIN))


def evaluate_run(
    run: RunFolder | str | Path, data_dir: str | None = None, write: bool = True, cache_dir: str | None = None
) -> dict:
    """Score a finished run's best model on its test flights with its stored cloud probe and intervals
    (changing neither); writes predictions.csv, evaluation.json and report.md. `run`: its folder (a path is
    taken as one). `data_dir`, `cache_dir`: where the flights and the preprocessing cache are now, if not
    where the run recorded them."""
    run = RunFolder.of(run)
    if write:
        # report.md, evaluation.json and predictions.csv are rewritten: only where CloudML proves its run
        from cloudml_lib.core.run.runfolder import check_takes_run

        run.check_run(trains=False, command="evaluate")  # a sweep's or cross-validation's, named so
        check_takes_run(run)
    rm = load_run_model(run, data_dir, cache_dir=cache_dir)
    cfg, ckpt = rm.cfg, rm.ckpt
    data = load_end_data(
        cfg, Scalers.from_dict(ckpt[Key.SCALERS]), ckpt.get(Key.PROVENANCE), ckpt.get(Key.SPLIT)
    )
    evaluator = Evaluator(rm.model, rm.device, rm.autocast, SINGLE, eval_batch_size(cfg.train.batch_size))
    scored = score(evaluator, data.test_set)
    validation = None if data.split.legacy else score(evaluator, data.val_set)
    weights = weights_sha256(ckpt[Key.MODEL])
    calibration = intervals.of_weights(intervals.load(run.path), weights, run.best)
    report = test_report(cfg, data, scored, trained_of(ckpt, data), calibration, validation)
    report["weights_sha256"] = weights
    if scored.cloud_prob is None:
        log.info(
            "%s has no cloud / no-cloud output (see above): the cloud metrics show the baselines only.",
            run.best,
        )
    if write:
        evaluated = read_evaluation(run)
        if evaluated and "step" in evaluated:  # the step of the weights it belongs to (run states)
            report["step"] = evaluated["step"]
        from cloudml_lib.core.run.resume import best_disagreement

        other = best_disagreement(run, ckpt)  # best.pt as read above
        if other:  # scored as asked, said where the report is read: the log, report.md, the card
            report["best_model"] = other
            log.warning("Note: %s.", other)  # the file's name as it is spelt, not capitalised
        write_evaluation(run, data.test_set, scored, report)
        write_report(run)
    return report


def read_evaluation(run: RunFolder) -> dict | None:
    """evaluation.json, read as untrusted (runfiles.py); None when it is missing or damaged."""
    return RunFiles(run.path).evaluation() or None


def write_evaluation(run: RunFolder, dataset: CloudDataset, scored: Scored, report: dict) -> None:
    """The test results of a run: predictions.csv, plots/scatter.png and evaluation.json."""
    write_predictions_and_figure(run, dataset, scored, report)
    write_evaluation_json(run, report)


def write_predictions_and_figure(run: RunFolder, dataset: CloudDataset, scored: Scored, report: dict) -> None:
    write_predictions(run.predictions, dataset, scored)
    has = dataset.has_height()
    plots.save_figure(
        plots.scatter_figure(
            dataset.targets_km()[has],
            scored.height_km[has],
            dataset.flight_names()[has],
            f"Test flights, pooled R2 {report['overall']['r2']:.2f}",
        ),
        run.plots / "scatter.png",
    )


def write_evaluation_json(run: RunFolder, report: dict) -> None:
    write_text(run.evaluation, json.dumps(json_safe(report), indent=1))
