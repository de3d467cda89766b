"""The training objective: a Huber loss on the standardised cloud base height, each sample weighted
(data.overweight_factor), with optional extra weight on the hardest examples of the batch."""
from __future__ import annotations

import torch.nn.functional as F


def weighted_huber(pred, target, weight, delta: float, hard_example_weight: float):
    """Huber loss on the standardised target; optional extra weight on examples with large errors."""
    per_sample = F.huber_loss(pred, target, reduction="none", delta=delta)
    if hard_example_weight > 0:
        err = (pred - target).abs().detach()
        weight = weight * (1.0 + hard_example_weight * err / (err.mean() + 1e-6))
    return (per_sample * weight).sum() / weight.sum()
