"""The training objective: a Huber loss on the standardised cloud base height of the samples that have
one, each sample weighted (data.overweight_factor), with optional extra weight on the hardest examples;
plus, with a cloud output, a binary cross-entropy on cloud / no-cloud over every sample, weighted by
train.cloud_loss_weight. Both are weighted means over the global batch, whatever its split into
micro-batches and processes."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from cloudml_lib.core.network.model import Outputs


def weighted_huber(pred, target, weight, delta: float, hard_example_weight: float):
    """Huber loss on the standardised target, the weighted mean over samples of non-zero weight (0 when none);
    optional extra weight on examples with large errors."""
    per_sample = F.huber_loss(pred, target, reduction="none", delta=delta)
    if hard_example_weight > 0:
        used = (weight > 0).float()
        err = (pred - target).abs().detach() * used
        weight = weight * (1.0 + hard_example_weight * err / (err.sum() / used.sum().clamp_min(1) + 1e-6))
    return (per_sample * weight).sum() / weight.sum().clamp_min(1e-12)


def cloud_terms(logit, cloud):
    """Each sample's cloud / no-cloud cross-entropy (from the logit): what part_loss weights and
    validation_loss averages."""
    return F.binary_cross_entropy_with_logits(logit, cloud, reduction="none")


def global_totals(batch: dict, all_sum) -> torch.Tensor:
    """The global batch's total weight of the samples with a height and of all samples, in one tensor of two
    (`all_sum` adds them over processes)."""
    weight = batch["weight"]
    return all_sum(torch.stack([(weight * batch["has_height"]).sum(), weight.sum()]))


def part_loss(
    out: Outputs,
    part: dict,
    totals: torch.Tensor,
    delta: float,
    hard_example_weight: float,
    cloud_weight: float,
    height_weight: float = 1.0,
) -> torch.Tensor:
    """This part of the global batch's share of its loss (exactly the loss when the batch is one part).
    `part`: target, has_height, cloud, weight on the device; `totals` from global_totals."""
    out = out.float()
    height, logit = out.height, out.cloud_logit
    w_height = part["weight"] * part["has_height"]
    loss = (
        height_weight
        * weighted_huber(height, part["target"], w_height, delta, hard_example_weight)
        * (w_height.sum() / totals[0].clamp_min(1e-12))
    )
    if logit is not None and cloud_weight > 0:
        bce = cloud_terms(logit, part["cloud"])
        loss = loss + cloud_weight * (bce * part["weight"]).sum() / totals[1].clamp_min(1e-12)
    return loss


def batch_loss(out: Outputs, batch: dict, t) -> torch.Tensor:
    """The loss of one whole batch on one process (`t`: the train config): for loops written by hand, such as
    the benchmarks' reference loop. A batch without has_height / cloud (a plain height batch) counts every
    sample as a cloudy frame with a height."""
    ones = torch.ones_like(batch["target"])
    part = {
        "target": batch["target"],
        "weight": batch.get("weight", ones),
        "has_height": batch.get("has_height", ones),
        "cloud": batch.get("cloud", ones),
    }
    return part_loss(
        out,
        part,
        global_totals(part, lambda x: x),
        t.huber_delta,
        t.hard_example_weight,
        t.cloud_loss_weight,
        t.height_loss_weight,
    )


def validation_loss(out: dict, target: np.ndarray, has: np.ndarray, flags: np.ndarray, cfg) -> float:
    """The objective over a validation set, from the model's outputs as float64 arrays (inference.predict), by
    the training's own terms (weighted_huber, cloud_terms) with every sample weighing one: the height's Huber
    loss over the samples with a height (train.height_loss_weight) plus, for a joint cloud output, the cloud
    cross-entropy over every sample (train.cloud_loss_weight). Plain means: the validation flights are not
    over-weighted, no example weighs extra, and early stopping compares the same quantity every epoch."""
    t = cfg.train
    loss = 0.0
    if has.any():
        height, truth = torch.from_numpy(out["height"][has]), torch.from_numpy(target[has])
        loss = t.height_loss_weight * float(
            weighted_huber(height, truth, torch.ones_like(truth), t.huber_delta, 0.0)
        )
    if out.get("cloud_logit") is not None and cfg.model.cloud_head == "joint":
        logits, truth = torch.from_numpy(out["cloud_logit"]), torch.from_numpy(flags.astype(np.float64))
        loss += t.cloud_loss_weight * float(cloud_terms(logits, truth).sum() / len(truth))
    return loss
