"""Scoring during training: each epoch's validation loss and metrics (`validate`, on the core's Evaluator) and
the best model kept (`update_best`, early stopping). The end of a run (the best weights scored on the whole
test flights, the cloud probe, the intervals, the report) is not training's: science/finish.py."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from cloudml_lib.base.config import Config
from cloudml_lib.core.network.inference import Evaluator
from cloudml_lib.core.network.metrics import Scored, cloud_metrics, regression_metrics
from cloudml_lib.data.dataset import CloudDataset
from cloudml_lib.train.loss import validation_loss

log = logging.getLogger(__name__)


def validate(
    evaluator: Evaluator, dataset: CloudDataset, indices: np.ndarray, cfg: Config
) -> tuple[float, dict, Scored]:
    """Validation loss (the training objective, loss.validation_loss), metrics (km; with a cloud output its
    accuracy and ROC-AUC) and the model's answers (`Scored`, in km) for `indices` of `dataset`."""
    out, target = evaluator.outputs(dataset, indices)
    assert isinstance(out, dict)  # the outputs by name (no `features`)
    scored = Scored.from_outputs(out, dataset.scalers)
    has = dataset.has_height()[indices]
    flags = dataset.cloud_flags()[indices]
    loss = validation_loss(out, target, has, flags, cfg)
    metrics = regression_metrics(dataset.targets_km()[indices][has], scored.height_km[has])
    if scored.cloud_prob is not None:
        cloud = cloud_metrics(flags, scored.cloud_prob, cfg.model.cloud_threshold)
        metrics.update(cloud_accuracy=cloud["accuracy"], cloud_auc=cloud["roc_auc"])
    return loss, metrics, scored


def update_best(
    progress,
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
    if finite_model and math.isfinite(val_loss) and val_loss < progress.best_val_loss:
        progress.best_val_loss, progress.best_epoch, progress.bad_epochs = val_loss, epoch, 0
        save_best()
        log.info("New best model saved (val_loss %.4f, epoch %d) -> %s", val_loss, epoch, best_path)
        return False
    progress.bad_epochs += 1
    if patience and progress.bad_epochs >= patience:
        log.info(
            "Early stopping: no better validation loss for %d epochs (best %.4f at epoch %d)",
            progress.bad_epochs,
            progress.best_val_loss,
            progress.best_epoch,
        )
        return True
    return False
