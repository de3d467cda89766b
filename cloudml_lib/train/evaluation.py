"""Scoring during and after training: validation after each epoch (with its own recoveries), the best
model kept, and the end of a run: full validation with the best weights, predictions, report, plots
and the final checkpoint. Functions of the Trainer, whose attributes they read."""
from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from cloudml_lib import intervals, plots
from cloudml_lib.checkpoint import fault_point, load_checkpoint, save_atomic, to_cpu, unwrap_model
from cloudml_lib.clouds import cloud_metrics, fit_probe
from cloudml_lib.data.dataset import CloudDataset
from cloudml_lib.errors import CloudMLError
from cloudml_lib.evaluate import Scored, build_report, format_report, predict, regression_metrics, write_evaluation
from cloudml_lib.recovery import MAX_ATTEMPTS, eager_after_compile_failure, halve_eval_batch, release_memory, run_attempt
from cloudml_lib.report import write_report

log = logging.getLogger(__name__)


def validate(tr, indices: np.ndarray | None = None) -> tuple[float, dict, Scored]:
    """Validation loss (the training objective: standardised Huber on the samples with a height, plus, for
    a joint cloud output, the weighted cloud cross-entropy), metrics (km; with a cloud output its accuracy
    and ROC-AUC) and the model's answers (`Scored`, in km) for `indices` (run_model's recoveries)."""
    indices = np.arange(len(tr.val_set)) if indices is None else indices
    out, target = run_model(tr, tr.val_set, indices)
    scored = Scored.from_outputs(out, tr.val_set.scalers)
    has = tr.val_set.has_height()[indices]
    loss = tr.cfg.train.height_loss_weight * float(F.huber_loss(torch.from_numpy(out["height"][has]), torch.from_numpy(
        target[has]), delta=tr.cfg.train.huber_delta)) if has.any() else 0.0
    metrics = regression_metrics(tr.val_set.targets_km()[indices][has], scored.height_km[has])
    if scored.cloud_prob is not None:
        flags = tr.val_set.cloud_flags()[indices]
        if tr.cfg.model.cloud_head == "joint":            # part of the objective only when trained with it
            bce = F.binary_cross_entropy_with_logits(torch.from_numpy(out["cloud_logit"]),
                                                     torch.from_numpy(flags.astype(np.float64)))
            loss += tr.cfg.train.cloud_loss_weight * float(bce)
        cloud = cloud_metrics(flags, scored.cloud_prob, tr.cfg.model.cloud_threshold)
        metrics.update(cloud_accuracy=cloud["accuracy"], cloud_auc=cloud["roc_auc"])
    return loss, metrics, scored


def run_model(tr, dataset, indices: np.ndarray, features: bool = False) -> tuple[dict | np.ndarray, np.ndarray]:
    """The model's outputs by name (or, with `features`, the head's input: model.features) and the
    standardised targets for `indices` of `dataset`, in order, on every process (each computes its part).

    Out of memory halves the evaluation batch (kept for the rest of the run); a compile failure
    switches to eager mode. The results do not depend on the evaluation batch size.
    """
    mine = indices[tr.dist.shard(len(indices))]
    for _ in range(MAX_ATTEMPTS):
        # With several processes, the plain module: DDP's forward (compiled or not) would wait for
        # matching calls in the others, whose parts may hold one batch more or less.
        forward = unwrap_model(tr.model).features if features else tr.model if tr.dist.active else tr.forward
        compiled = tr.compile.report.active or (not features and forward is not tr.model)
        result, failure = run_attempt(lambda: predict(
            unwrap_model(tr.model), dataset, tr.device, tr.state["eval_batch_size"], tr.autocast, mine,
            tr.num_workers, forward=forward, features=features), compiled)
        if failure is None:
            parts = tr.dist.gather(result)                          # each process's (outputs, targets), in rank order
            targets = np.concatenate([t for _, t in parts])
            if features:
                return np.concatenate([o for o, _ in parts]), targets
            return {k: None if parts[0][0][k] is None else np.concatenate([o[k] for o, _ in parts])
                    for k in parts[0][0]}, targets
        release_memory(tr.device)
        if failure == "oom":
            halve_eval_batch(tr.state)
        else:
            tr.forward = eager_after_compile_failure(tr.ddp, tr.compile, failure)
            tr.run_info.write()
    raise CloudMLError("validation kept failing after every recovery was tried; see the log above")


def matched_training_frames(tr) -> CloudDataset:
    """Every frame of the training flights that a CPL profile matches, without augmentation: what the probe
    and the cloud baselines are fitted on (the training set itself holds only the frames with a height,
    unless the cloud output is joint)."""
    if tr.cfg.model.cloud_head == "joint":
        return tr.train_set
    return CloudDataset(tr.train_set.caches, tr.train_set.scalers, sun_azimuth=tr.cfg.data.sun_azimuth, cloud=True)


def fit_cloud_probe(tr, frames: CloudDataset) -> None:
    """model.cloud_head probe: fit the cloud output on the loaded (best) weights' features of every frame of
    the training flights that a CPL profile matches (clear sky and cloud without a height included; no
    augmentation), put it in the model and into best.pt. Deterministic, so a run stopped here and
    continued fits the same probe again."""
    model = unwrap_model(tr.model)
    t0 = time.perf_counter()
    features, _ = run_model(tr, frames, np.arange(len(frames)), features=True)
    flags = frames.cloud_flags()
    fitted = fit_probe(features, flags)
    if fitted is None:
        log.warning("The cloud / no-cloud output cannot be fitted: the training flights' %d matched frames are all %s. "
                    "The model answers heights only (predict flags no frame). Add a flight with %s frames to train "
                    "it.", len(flags), "cloudy" if flags.all() else "clear", "clear-sky" if flags.all() else "cloudy")
        return
    weight, bias = fitted
    model.set_cloud_probe(torch.as_tensor(weight, dtype=model.cloud.weight.dtype), bias)
    log.info("Cloud / no-cloud output fitted on the trained network's features (logistic regression) over %d frames "
             "of the training flights (%d clear sky) in %.1f s", len(flags), int((flags == 0).sum()),
             time.perf_counter() - t0)
    best = tr.run_dir / "best.pt"
    if tr.dist.is_main and best.exists():
        ckpt = load_checkpoint(best)
        ckpt["model"] = to_cpu(dict(model.state_dict()))
        save_atomic(ckpt, best)
    fault_point("probe-fitted")


def update_best(tr, val_loss: float, epoch: int) -> bool:
    """Save a better model; returns True when early stopping says stop."""
    s = tr.state
    finite_model = all(bool(torch.isfinite(p).all()) for p in tr.model.parameters())
    if not finite_model:
        log.warning("The model has NaN/inf weights after epoch %d: it is not saved as best", epoch)
    if finite_model and math.isfinite(val_loss) and val_loss < s["best_val_loss"]:
        s["best_val_loss"], s["best_epoch"], s["bad_epochs"] = val_loss, epoch, 0
        if tr.dist.is_main:
            tr.save_best()
        log.info("New best model saved (val_loss %.4f, epoch %d) -> %s", val_loss, epoch, tr.run_dir / "best.pt")
        return False
    s["bad_epochs"] += 1
    patience = tr.cfg.train.early_stopping_patience
    if patience and s["bad_epochs"] >= patience:
        log.info("Early stopping: no better validation loss for %d epochs (best %.4f at epoch %d)",
                 s["bad_epochs"], s["best_val_loss"], s["best_epoch"])
        return True
    return False


def evaluate_best(tr) -> dict:
    """Full validation with the best weights (the newest if best.pt cannot be used, which is then
    rewritten); rank 0 writes evaluation.json, predictions.csv and the scatter plot."""
    best = tr.run_dir / "best.pt"
    if best.exists():
        try:
            tr.model.load_state_dict(load_checkpoint(best)["model"])
        except (CloudMLError, RuntimeError, KeyError, TypeError) as e:
            log.warning("%s cannot be used (%s). The final evaluation uses the newest weights (epoch %d) instead, "
                        "and best.pt is rewritten with them.", best, str(e).splitlines()[0], tr.state["epoch"])
            tr.state["best_epoch"] = tr.state["epoch"]
            if tr.dist.is_main:
                tr.save_best()
    frames = matched_training_frames(tr)
    if tr.cfg.model.cloud_head == "probe":
        fit_cloud_probe(tr, frames)
    _, _, scored = tr.validate()
    has = tr.val_set.has_height()
    names = ", ".join(c.name for c in tr.val_set.caches)
    calibration = intervals.calibrate(scored.height_km[has], tr.val_set.targets_km()[has], "conformal_absolute",
                                      tr.cfg.train.interval_coverage, f"this run's held-out flights ({names})")
    report = build_report(tr.val_set, scored, float(np.nanmean(tr.train_set.targets_km())), tr.state["best_epoch"],
                          frames, tr.cfg.model.cloud_threshold, calibration)
    if tr.dist.is_main:
        write_evaluation(tr.run_dir, tr.val_set, scored, report)
        intervals.save(tr.run_dir, calibration)
    return report


def finish(tr) -> dict:
    """Full validation with the best weights; predictions, report, plots; the final checkpoint."""
    writer = tr.checkpoints.writer
    if writer is not None:
        writer.wait()
    tr.dist.barrier()                                 # rank 0's best.pt is written before anyone reads it
    report = evaluate_best(tr)
    tr.state["finished"] = True
    if tr.dist.is_main:
        tr._append_metrics({"kind": "final", "epoch": tr.state["epoch"], "step": tr.state["step"],
                            **report["overall"], "baseline": report["baseline"], "per_flight": report["per_flight"]})
        if tr.state["history"]:
            plots.save_figure(plots.curves_figure(tr.state["history"]), tr.run_dir / "plots" / "curves.png")
        write_report(tr.run_dir)
        tr.events.scalars(tr.state["step"], {f"final/{k}": v for k, v in report["overall"].items()})
        tr.events.image(tr.state["step"], "evaluation/scatter", tr.run_dir / "plots" / "scatter.png")
    tr.save_checkpoint("final", wait=True)            # every rank: the snapshot gathers from all of them
    tr.dist.barrier()
    if not tr.dist.is_main:
        return report
    if writer.failures_in_a_row:
        raise CloudMLError(f"the final checkpoint could not be written ({writer.last_error}); the results "
                           f"are in {tr.run_dir}, but the run is not marked finished. Free space or fix the "
                           "folder's permissions, then run the same command again.")
    log.info("Full validation with the best model (epoch %d):\n%s", tr.state["best_epoch"], format_report(report))
    log.info("Run directory: %s (best.pt, predictions.csv, evaluation.json, plots/)", tr.run_dir)
    return report


def stored_report(tr) -> dict:
    """A finished run's report; a missing or damaged evaluation.json is computed again from best.pt."""
    path = tr.run_dir / "evaluation.json"
    try:
        report = json.loads(path.read_text())
        format_report(report)                           # the structure a report has
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        why = "missing" if isinstance(e, FileNotFoundError) else f"damaged ({type(e).__name__})"
        log.warning("%s is %s: scoring best.pt on the validation flights again", path, why)
        report = evaluate_best(tr)
        if tr.dist.is_main:
            write_report(tr.run_dir)
    log.info("Its report:\n%s", format_report(report))
    return report
