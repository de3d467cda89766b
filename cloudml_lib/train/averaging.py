"""Weight averaging: an exponential moving average (EMA) of the weights, the one a run validates, keeps as
best.pt and ends with (`train.ema_decay`).

On the demo the validation score of the raw weights swung from epoch to epoch while the training loss fell
steadily (benchmarks/stability.py measures it): each step moves the weights by what one small batch says, and
a validation flight the network never fitted shows that noise. The average over the last steps is a point near
the middle of where the steps wander (timm's ModelEmaV2, Polyak averaging), so its score moves little between
epochs and the epoch chosen on it is not the luck of one batch. torch's own `AveragedModel` keeps it, with the
BatchNorm statistics averaged too (`use_buffers`): the average's statistics belong to the average's weights.

Its decay warms up: after n updates it is min(decay, (1 + n) / (10 + n)) (TensorFlow's
ExponentialMovingAverage with `num_updates`, timm's EMA warm-up), so the average follows the weights closely
while they still move fast and averages over its full span only later: the epoch a run chooses is often an
early one, where an average without it would still carry the first, worse weights. Measured on the demo
(benchmarks/results/stability.json): the same test skill at the chosen epoch as the raw weights, half the
test score's move from one epoch to the next, and the validation score's cut by more than half.

The average is made before the model is compiled or wrapped (a copy of a compiled module would call the
original's compiled code), updated after every optimizer step that is taken, saved in every checkpoint under
its own key (`Key.EMA`) and restored exactly: a resumed run's average is the uninterrupted run's. A run made
before the setting existed has none and keeps training and validating its raw weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

# the steps the auto decay averages over: EMA_SPAN_SHARE of the run's optimizer steps, within EMA_SPAN_STEPS
EMA_SPAN_SHARE, EMA_SPAN_STEPS = 0.1, (10, 2000)


def resolve_decay(setting, total_steps: int) -> float:
    """train.ema_decay as a number: auto averages over about EMA_SPAN_SHARE of the run's optimizer steps
    (decay 1 - 1/span, span within EMA_SPAN_STEPS), so a short run's average is not mostly its start and a
    long one's not only its last batches; 0: off."""
    if setting != "auto":
        return float(setting)
    low, high = EMA_SPAN_STEPS
    span = min(max(EMA_SPAN_SHARE * total_steps, low), high)
    return 1.0 - 1.0 / span


class WeightAverage:
    """The EMA of a model's weights and BatchNorm statistics: `module` is the averaged model (evaluated,
    saved as best.pt), `update` folds in the model's weights after an optimizer step; its state_dict() is
    plain tensors and numbers."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.99):
        """A copy of `model` (made before it is compiled or wrapped); `decay` may be set until the first
        update (the build knows the run's steps only later)."""
        self.decay = decay
        self.updates = 0  # counted here too: reading the module's counter would sync the GPU every step
        self.averaged = AveragedModel(model, multi_avg_fn=self._ema, use_buffers=True)

    def _ema(self, averaged: Sequence[torch.Tensor], current: Sequence[torch.Tensor], n_averaged) -> None:
        assert 0.0 < self.decay < 1.0, f"an EMA decay of {self.decay}"
        get_ema_multi_avg_fn(self.decay_after(self.updates))(averaged, current, n_averaged)

    def decay_after(self, n: int) -> float:
        """The decay of the update that follows `n` updates: warmed up (the module's docstring)."""
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @property
    def module(self) -> torch.nn.Module:
        return self.averaged.module

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """After an optimizer step: average = decay x average + (1 - decay) x weights (the first: a copy)."""
        self.averaged.update_parameters(model)
        self.updates += 1

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "n_averaged": self.updates,
            "weights": dict(self.module.state_dict()),
        }

    def load_state_dict(self, saved: dict) -> None:
        self.module.load_state_dict(saved["weights"])
        self.updates = int(saved["n_averaged"])
        self.averaged.n_averaged.fill_(self.updates)

    def describe(self, total_steps: int) -> str:
        return (
            f"weights averaged (EMA, decay {self.decay:.4f}, warmed up: about the last "
            f"{1 / (1 - self.decay):.0f} of {total_steps} optimizer steps), validated and kept as best.pt"
        )
