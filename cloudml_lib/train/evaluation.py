"""Scoring during and after training: the model's outputs on a dataset with the recoveries of evaluation
(`Evaluator`), the validation loss and metrics, the best model kept (early stopping), and the pieces of a
run's end the Trainer puts together: the best weights loaded back, the cloud probe fitted, the full
evaluation with its intervals."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cloudml_lib import faults, intervals
from cloudml_lib.checkpoint import Key, load_checkpoint, save_atomic, to_cpu, unwrap_model
from cloudml_lib.clouds import cloud_metrics, fit_probe
from cloudml_lib.compile import CompileWatch
from cloudml_lib.config import Config, height_bounds_km
from cloudml_lib.data.dataset import CloudDataset
from cloudml_lib.distributed import Dist
from cloudml_lib.errors import CloudMLError
from cloudml_lib.evaluate import (
    Scored,
    build_report,
    predict,
    regression_metrics,
    write_evaluation,
)
from cloudml_lib.recovery import MAX_ATTEMPTS, halve_eval_batch, release_memory, run_attempt

log = logging.getLogger(__name__)


class Evaluator:
    """The model's outputs on the samples of a dataset, in eval mode, each process computing its part. Out of
    GPU memory halves the evaluation batch (`progress["eval_batch_size"]`, kept for the rest of the run); a
    compile failure calls `on_compile_failure` (the Trainer switches to eager) and the batch is redone. The
    results do not depend on the evaluation batch size."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        autocast: Callable,
        dist: Dist,
        num_workers: int,
        compiled: CompileWatch,
        progress: dict,
        on_compile_failure: Callable[[str], None],
    ):
        self.model, self.device, self.autocast, self.dist = unwrap_model(model), device, autocast, dist
        self.num_workers, self.compiled, self.progress = num_workers, compiled, progress
        self.on_compile_failure = on_compile_failure

    def outputs(
        self, dataset: CloudDataset, indices: np.ndarray, features: bool = False
    ) -> tuple[dict | np.ndarray, np.ndarray]:
        """The model's outputs by name (or, with `features`, the head's input) and the standardised targets of
        `indices` of `dataset`, in order, on every process."""
        mine = indices[self.dist.shard(len(indices))]
        for _ in range(MAX_ATTEMPTS):
            result, failure = run_attempt(
                lambda: predict(
                    self.model,
                    dataset,
                    self.device,
                    self.progress["eval_batch_size"],
                    self.autocast,
                    mine,
                    self.num_workers,
                    features=features,
                ),
                self.compiled.report.active,
            )
            if failure is None:
                return _gathered(self.dist.gather(result), features)
            release_memory(self.device)
            if failure == "oom":
                halve_eval_batch(self.progress)
            else:
                self.on_compile_failure(failure)
        raise CloudMLError("validation kept failing after every recovery was tried; see the log above")

    def validate(self, dataset: CloudDataset, indices: np.ndarray, cfg: Config) -> tuple[float, dict, Scored]:
        """Validation loss (the training objective: standardised Huber on the samples with a height, plus, for
        a joint cloud output, the weighted cloud cross-entropy), metrics (km; with a cloud output its accuracy
        and ROC-AUC) and the model's answers (`Scored`, in km) for `indices` of `dataset`."""
        out, target = self.outputs(dataset, indices)
        scored = Scored.from_outputs(out, dataset.scalers)
        has = dataset.has_height()[indices]
        loss = (
            cfg.train.height_loss_weight
            * float(
                F.huber_loss(
                    torch.from_numpy(out["height"][has]),
                    torch.from_numpy(target[has]),
                    delta=cfg.train.huber_delta,
                )
            )
            if has.any()
            else 0.0
        )
        metrics = regression_metrics(dataset.targets_km()[indices][has], scored.height_km[has])
        if scored.cloud_prob is not None:
            flags = dataset.cloud_flags()[indices]
            if cfg.model.cloud_head == "joint":  # part of the objective only when trained with it
                bce = F.binary_cross_entropy_with_logits(
                    torch.from_numpy(out["cloud_logit"]), torch.from_numpy(flags.astype(np.float64))
                )
                loss += cfg.train.cloud_loss_weight * float(bce)
            cloud = cloud_metrics(flags, scored.cloud_prob, cfg.model.cloud_threshold)
            metrics.update(cloud_accuracy=cloud["accuracy"], cloud_auc=cloud["roc_auc"])
        return loss, metrics, scored


def _gathered(parts: list, features: bool) -> tuple[dict | np.ndarray, np.ndarray]:
    """Each process's (outputs, targets), in rank order, as one."""
    targets = np.concatenate([t for _, t in parts])
    if features:
        return np.concatenate([o for o, _ in parts]), targets
    first = parts[0][0]
    return {k: None if first[k] is None else np.concatenate([o[k] for o, _ in parts]) for k in first}, targets


def update_best(
    progress: dict,
    val_loss: float,
    epoch: int,
    model: torch.nn.Module,
    patience: int,
    save_best: Callable[[], None],
    best_path: Path,
) -> bool:
    """A better validation loss (with finite weights) saves the best model; returns True when early stopping
    says stop (`patience` epochs without a better one; 0: never)."""
    finite_model = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if not finite_model:
        log.warning("The model has NaN/inf weights after epoch %d: it is not saved as best", epoch)
    if finite_model and math.isfinite(val_loss) and val_loss < progress["best_val_loss"]:
        progress["best_val_loss"], progress["best_epoch"], progress["bad_epochs"] = val_loss, epoch, 0
        save_best()
        log.info("New best model saved (val_loss %.4f, epoch %d) -> %s", val_loss, epoch, best_path)
        return False
    progress["bad_epochs"] += 1
    if patience and progress["bad_epochs"] >= patience:
        log.info(
            "Early stopping: no better validation loss for %d epochs (best %.4f at epoch %d)",
            progress["bad_epochs"],
            progress["best_val_loss"],
            progress["best_epoch"],
        )
        return True
    return False


def load_best_weights(
    model: torch.nn.Module, best_path: Path, progress: dict, save_best: Callable[[], None]
) -> None:
    """The best weights into `model`; when best.pt cannot be used, the newest weights stay and best.pt is
    rewritten with them."""
    if not best_path.exists():
        return
    try:
        model.load_state_dict(load_checkpoint(best_path)[Key.MODEL])
    except (CloudMLError, RuntimeError, KeyError, TypeError) as e:
        log.warning(
            "%s cannot be used (%s). The final evaluation uses the newest weights (epoch %d) instead, "
            "and best.pt is rewritten with them.",
            best_path,
            str(e).splitlines()[0],
            progress["epoch"],
        )
        progress["best_epoch"] = progress["epoch"]
        save_best()


def matched_training_frames(cfg: Config, train_set: CloudDataset) -> CloudDataset:
    """Every frame of the training flights that a CPL profile matches, without augmentation: what the probe
    and the cloud baselines are fitted on (the training set itself holds only the frames with a height,
    unless the cloud output is joint)."""
    if cfg.model.cloud_head == "joint":
        return train_set
    return CloudDataset(train_set.caches, train_set.scalers, sun_azimuth=cfg.data.sun_azimuth, cloud=True)


def fit_cloud_probe(evaluator: Evaluator, frames: CloudDataset, best_path: Path, dist: Dist) -> None:
    """model.cloud_head probe: fit the cloud output on the loaded (best) weights' features of every frame of
    the training flights that a CPL profile matches (clear sky and cloud without a height included; no
    augmentation), put it in the model and into best.pt. Deterministic, so a run stopped here and
    continued fits the same probe again."""
    model = evaluator.model
    t0 = time.perf_counter()
    features, _ = evaluator.outputs(frames, np.arange(len(frames)), features=True)
    flags = frames.cloud_flags()
    fitted = fit_probe(features, flags)
    if fitted is None:
        log.warning(
            "The cloud / no-cloud output cannot be fitted: the training flights' %d matched frames are all "
            "%s. "
            "The model answers heights only (predict flags no frame). Add a flight with %s frames to train "
            "it.",
            len(flags),
            "cloudy" if flags.all() else "clear",
            "clear-sky" if flags.all() else "cloudy",
        )
        return
    weight, bias = fitted
    model.set_cloud_probe(torch.as_tensor(weight, dtype=model.cloud.weight.dtype), bias)
    log.info(
        "Cloud / no-cloud output fitted on the trained network's features (logistic regression) over %d "
        "frames "
        "of the training flights (%d clear sky) in %.1f s",
        len(flags),
        int((flags == 0).sum()),
        time.perf_counter() - t0,
    )
    if dist.is_main and best_path.exists():
        ckpt = load_checkpoint(best_path)
        ckpt[Key.MODEL] = to_cpu(dict(model.state_dict()))
        save_atomic(ckpt, best_path)
    faults.point("probe-fitted")


def held_out_report(
    cfg: Config,
    scored: Scored,
    train_set: CloudDataset,
    val_set: CloudDataset,
    frames: CloudDataset,
    best_epoch: int,
) -> tuple[dict, dict | None]:
    """The full evaluation of the best model on the held-out flights (its verdict, and how many predictions
    lie outside the heights a cloud base can have) and the calibration of its intervals."""
    has = val_set.has_height()
    names = ", ".join(c.name for c in val_set.caches)
    calibration = intervals.calibrate(
        scored.height_km[has],
        val_set.targets_km()[has],
        "conformal_absolute",
        cfg.train.interval_coverage,
        f"this run's held-out flights ({names})",
    )
    report = build_report(
        val_set,
        scored,
        float(np.nanmean(train_set.targets_km())),
        best_epoch,
        frames,
        cfg.model.cloud_threshold,
        calibration,
        height_bounds_km(cfg.data),
    )
    return report, calibration


def write_held_out(run_dir: Path, val_set: CloudDataset, scored: Scored, report: dict, calibration) -> None:
    """evaluation.json, predictions.csv, the scatter plot and intervals.json (rank 0)."""
    write_evaluation(run_dir, val_set, scored, report)
    intervals.save(run_dir, calibration)


def read_stored_report(path: Path) -> dict | None:
    """A finished run's evaluation.json; None (said why) when it is missing or damaged."""
    from cloudml_lib.runfiles import RunFiles

    files = RunFiles(path.parent)
    report = files.evaluation()
    if files.damaged or not report:
        why = files.damaged[0] if files.damaged else f"missing: {path}"
        log.warning("%s: scoring best.pt on the validation flights again", why)
        return None
    return report
