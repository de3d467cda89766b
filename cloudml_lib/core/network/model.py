"""MultimodalRegressionModel: cloud base height from T thermal-IR frames and the solar angles.

The network only: no device, AMP or compile code (train/build.py applies those from outside).

    frames (B, T, H, W) --per frame--> 3 conv blocks -> spatial attention -> pooled (B, T, C)
    scalars (B, S) --> FiLM: gamma, beta (B, C) modulate every frame's features
    softmax attention over the T frames -> (B, C) -> MLP head -> Outputs(height, cloud_logit)

The scalars (data/dataset.py scalar_inputs) are the sun's angles (S = 3) and, with data.radiometry, the
labelled frame's radiometric statistics (S = 3 + K): the temperatures the frames' per-frame reading removes.

In eval mode a frame's encoding does not depend on its neighbours, so consecutive windows (a whole
flight, one window per frame) need each frame encoded once: `encode_frames`, then `pool_frames` and `output`
give the numbers of `forward` (inference.py does this). Training keeps the per-window path.

The cloud logit (`cloud_head`):
- "probe": a linear layer on the head's input (pooled features and angles), not trained with the
  network: `fit_cloud_probe` sets it when training ends (train/evaluation.py). Until then the model
  answers the height alone, and the height is trained exactly as with "none" (the layer is made
  without drawing from the random generator, and gets no gradient).
- "joint": the MLP head's second output, trained with the height (train/loss.py).
- "none": no cloud output.

The probe's classes (data.cloud_flag): one logit, cloud or not (any_layer: any CPL layer), or one logit per
cloud class (base_in_range: clear sky, a cloud base in the label range, high cloud alone, a base below the
range; data/cpl.py CLASS_MEANINGS), a softmax whose in-range share is the cloud flag's probability.

The model answers `Outputs`, named fields: `height` (B,) (standardised), `cloud_logit` (B,) (the logit of the
cloud flag; None without a cloud output) and `cloud_classes` (B, K) (the class logits of a probe with classes;
None otherwise), whatever the cloud head; a new output is one more field there.

The height (`height_head`):
- "bounded": a sigmoid scaled between the heights a cloud base can have (config.height_bounds_km: the
  surface to data.cbh_max_km), placed in the standardised units of the training targets (`build_model`
  with the run's scalers), so no answer lies below the surface or above the labels' range. Computed in
  float32 under mixed precision, so a half-precision rounding cannot step outside.
- "unbounded": the head's linear output, as every run made before model.height_head existed (predict masks
  its heights outside the bounds).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from cloudml_lib.base.config import (
    BASE_IN_RANGE,
    CLASS_MEANINGS,
    CLOUD_HEADS,
    HEIGHT_HEADS,
    height_bounds_km,
    n_scalar_inputs,
)


class Outputs(NamedTuple):
    """What the model answers for each of B windows."""

    height: torch.Tensor  # (B,) standardised cloud base height
    cloud_logit: torch.Tensor | None  # (B,) logit of the cloud flag; None: no cloud output
    cloud_classes: torch.Tensor | None = None  # (B, K) logits of the cloud classes; None: no classes

    def float(self) -> Outputs:
        return Outputs(*(None if t is None else t.float() for t in self))


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c_out)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x):
        return self.pool(torch.relu(self.bn(self.conv(x))))


class SpatialAttention(nn.Module):
    """Weights each location of a feature map from its channel mean and max (CBAM-style)."""

    def __init__(self, kernel: int = 7):
        super().__init__()
        self.conv = nn.Conv2d(2, 1, kernel, padding=kernel // 2)

    def forward(self, x):  # (N, C, h, w)
        desc = torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], dim=1)
        return x * torch.sigmoid(self.conv(desc))


class FrameEncoder(nn.Module):
    """One frame -> one feature vector."""

    def __init__(self, channels: list[int]):
        super().__init__()
        c1, c2, c3 = channels
        self.blocks = nn.Sequential(ConvBlock(1, c1), ConvBlock(c1, c2), ConvBlock(c2, c3))
        self.attention = SpatialAttention()

    def forward(self, x):  # (N, 1, H, W)
        return self.attention(self.blocks(x)).mean(dim=(2, 3))  # (N, C)


@contextmanager
def frozen_batchnorm_stats(module: nn.Module):
    """BatchNorm running statistics come out of the block exactly as they went in.

    Wraps the recomputation under gradient checkpointing, which runs BatchNorm forward a second
    time in training mode: without it the running mean, variance and batch count are updated
    twice per step. The layers compute exactly as in the first pass (same batch statistics, same
    saved tensors, as checkpointing requires); only their buffers are put back afterwards.
    """
    bns = [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    saved = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked)] for m in bns]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (mean, var, count) in zip(bns, saved):
                m.running_mean.copy_(mean)
                m.running_var.copy_(var)
                m.num_batches_tracked.copy_(count)


class MultimodalRegressionModel(nn.Module):
    def __init__(
        self,
        channels: list[int] = (64, 128, 256),
        n_scalars: int = 3,
        dropout: float = 0.3,
        scalars_only: bool = False,
        cloud_head: str = "none",
        height_head: str = "unbounded",
        height_range: tuple[float, float] = (-3.0, 3.0),
        cloud_classes: int = 1,
    ):
        """`height_range`: the bounded head's (low, high) in the standardised units of the height (build_model
        places the cloud base's bounds there with the run's scalers); unused by the unbounded head.
        `cloud_classes`: the probe's outputs, 1 (a logit) or len(CLASS_MEANINGS) (class logits)."""
        super().__init__()
        if cloud_head not in CLOUD_HEADS:
            raise ValueError(f"cloud_head: {cloud_head!r}; expected one of {CLOUD_HEADS}")
        if height_head not in HEIGHT_HEADS:
            raise ValueError(f"height_head: {height_head!r}; expected one of {HEIGHT_HEADS}")
        assert height_range[0] < height_range[1], f"height_range {height_range} is empty"
        c = channels[-1]
        self.scalars_only, self.cloud_head = scalars_only, cloud_head
        # Python floats, not tensors: fixed for the model's life, constants to torch.compile, never in weights
        self.height_head, self.height_range = height_head, (float(height_range[0]), float(height_range[1]))
        self.encoder = FrameEncoder(list(channels))
        self.film = nn.Sequential(nn.Linear(n_scalars, 64), nn.ReLU(), nn.Linear(64, 2 * c))
        self.temporal = nn.Sequential(nn.Linear(c, 64), nn.Tanh(), nn.Linear(64, 1))
        self.head = nn.Sequential(
            nn.Dropout(dropout),
            nn.Linear(c + n_scalars, 128),
            nn.ReLU(),
            nn.Dropout(dropout / 2),
            nn.Linear(128, 2 if cloud_head == "joint" else 1),
        )
        if cloud_head == "probe":
            assert cloud_classes in (1, len(CLASS_MEANINGS)), f"cloud_classes {cloud_classes}"
            with torch.random.fork_rng(devices=[]):  # the other layers' draws stay those of "none"
                self.cloud = nn.Linear(c + n_scalars, cloud_classes)
            nn.init.zeros_(self.cloud.weight)
            nn.init.zeros_(self.cloud.bias)
            self.cloud.requires_grad_(False)
            self.register_buffer("cloud_fitted", torch.zeros((), dtype=torch.uint8))
            self.register_load_state_dict_post_hook(lambda module, _keys: module._sync_cloud_output())
        # a Python flag, not a tensor read in forward: the output's shape must be fixed for torch.compile
        self.cloud_output = cloud_head == "joint"
        self.grad_checkpointing = False

    def _sync_cloud_output(self) -> None:
        if self.cloud_head == "probe":
            self.cloud_output = bool(self.cloud_fitted)

    def clear_cloud_probe(self) -> None:
        """Back to no fitted probe (training again): the model answers the height alone."""
        if self.cloud_head == "probe":
            with torch.no_grad():
                self.cloud.weight.zero_()
                self.cloud.bias.zero_()
                self.cloud_fitted.zero_()
            self._sync_cloud_output()

    def set_cloud_probe(self, weight: torch.Tensor, bias) -> None:
        """Put a fitted probe (weights over `features` (K, C + S), biases (K,)) in place; the model then
        answers a cloud logit too."""
        with torch.no_grad():
            self.cloud.weight.copy_(weight.reshape(self.cloud.weight.shape))
            self.cloud.bias.copy_(torch.as_tensor(bias, dtype=self.cloud.bias.dtype).reshape(-1))
            self.cloud_fitted.fill_(1)
        self._sync_cloud_output()

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def _encode(self, frame):  # (B, H, W)
        return self.encoder(frame.unsqueeze(1))  # (B, C)

    def _encode_checkpointed(self, frame):
        if torch.compiler.is_compiling():
            # Traced by torch.compile: the checkpointed region is recomputed inside the compiled backward
            # graph, where BatchNorm's running statistics are outputs of the forward alone, so the
            # recomputation never updates them a second time (and Dynamo cannot trace a context_fn).
            return checkpoint(self._encode, frame, use_reentrant=False)
        # Eager: context_fn gives (context of the first forward, context of the recomputation in backward).
        return checkpoint(
            self._encode,
            frame,
            use_reentrant=False,
            context_fn=lambda: (_null(), frozen_batchnorm_stats(self.encoder)),
        )

    def forward(self, frames, scalars):  # (B, T, H, W), (B, S)
        return self.output(self.features(frames, scalars))

    def output(self, features) -> Outputs:  # (B, C + S)
        """The head on `features`: the standardised height and, with a cloud output, the cloud logit."""
        out = self.head(features)  # (B, 1) or (B, 2)
        height = self.height(out[:, 0])
        if self.cloud_head == "joint":
            return Outputs(height, out[:, 1])
        if self.cloud_output:  # a fitted probe
            logits = self.cloud(features.detach())  # (B, K)
            if logits.shape[1] == 1:
                return Outputs(height, logits[:, 0])
            return Outputs(height, in_range_logit(logits), logits)
        return Outputs(height, None)

    def height(self, raw):  # (B,)
        """The standardised height from the head's raw output: as it is (unbounded), or squeezed into
        `height_range` (bounded; in float32, which mixed precision leaves elementwise operations in)."""
        if self.height_head == "unbounded":
            return raw
        low, high = self.height_range
        return low + (high - low) * torch.sigmoid(raw.float())

    @property
    def feature_width(self) -> int:
        """C, the width of one frame's encoding."""
        return self.temporal[0].in_features

    def encode_frames(self, frames):  # (N, H, W)
        """Each frame's encoding, (N, C): the frame encoder alone (zeros for a scalars-only model)."""
        if self.scalars_only:
            return torch.zeros(frames.shape[0], self.feature_width, device=frames.device, dtype=frames.dtype)
        return self._encode(frames)

    def features(self, frames, scalars):  # (B, T, H, W), (B, S)
        """The head's input: the frames' pooled features and the scalars, (B, C + S)."""
        b, t = frames.shape[:2]
        if self.scalars_only:
            feats = torch.zeros(b, t, self.feature_width, device=frames.device, dtype=scalars.dtype)
        else:
            # One CNN pass per frame, checkpointed or not, so BatchNorm sees the same batches
            # (and updates its running statistics the same T times) either way.
            encode = (
                self._encode_checkpointed
                if self.grad_checkpointing and self.training and torch.is_grad_enabled()
                else self._encode
            )
            feats = torch.stack([encode(frames[:, i]) for i in range(t)], dim=1)  # (B, T, C)
        return self.pool_frames(feats, scalars)

    def pool_frames(self, feats, scalars):  # (B, T, C), (B, S)
        """The scalars' FiLM on each frame's features, attention over the T frames, pooled; with the scalars
        appended: the head's input (B, C + S)."""
        gamma, beta = self.film(scalars).chunk(2, dim=-1)  # (B, C) each
        feats = feats * (1 + gamma.unsqueeze(1)) + beta.unsqueeze(1)
        weights = torch.softmax(self.temporal(feats).squeeze(-1), dim=1)  # (B, T)
        pooled = (weights.unsqueeze(-1) * feats).sum(dim=1)  # (B, C)
        return torch.cat([pooled, scalars], dim=-1)


def in_range_logit(logits):  # (B, K)
    """The logit of "a cloud base in the range" against every other class, from the class logits."""
    others = torch.cat([logits[:, :BASE_IN_RANGE], logits[:, BASE_IN_RANGE + 1 :]], dim=1)
    return logits[:, BASE_IN_RANGE] - torch.logsumexp(others, dim=1)


@contextmanager
def _null():
    yield


def build_model(cfg, scalers=None) -> MultimodalRegressionModel:
    """The network `cfg` describes. `scalers` (the run's, data/dataset.py Scalers): the standardisation of
    the height, which places the bounded head's range (config.height_bounds_km) in the units the model
    answers in; every model that trains or predicts gets them (train/build.py, evaluate.load_run_model).
    Without them (memory estimates, benchmarks) the range assumes the height's mean 0 km and spread 1 km."""
    mean, std = (scalers.cbh_mean, scalers.cbh_std) if scalers is not None else (0.0, 1.0)
    low, high = height_bounds_km(cfg.data)
    return MultimodalRegressionModel(
        channels=cfg.channels,
        n_scalars=n_scalar_inputs(cfg.data.radiometry, atmosphere_inputs(cfg, scalers)),
        dropout=cfg.model.dropout,
        scalars_only=cfg.model.scalars_only
        or (cfg.data.atmosphere == "alone" and bool(atmosphere_inputs(cfg, scalers))),
        cloud_head=cfg.model.cloud_head,
        height_head=cfg.model.height_head,
        height_range=((low - mean) / std, (high - mean) / std),
        cloud_classes=len(CLASS_MEANINGS) if cfg.data.cloud_flag == "base_in_range" else 1,
    )


def atmosphere_inputs(cfg, scalers=None) -> int:
    """How many atmosphere predictors the network of `cfg` reads: the run's scalers' (fitted where the
    flights had ERA5 files, data/predictors.py); without scalers (memory estimates) none."""
    return 0 if scalers is None or cfg.data.atmosphere == "none" else scalers.n_atmosphere


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def training_memory_format(device: torch.device) -> tuple[bool, str]:
    """Whether a run trains in channels_last memory format on this kind of device, and why: where
    benchmarks/memory_format.py measured it to pay (as predict follows benchmarks/predict.py). The numbers
    agree with the default format's to float rounding."""
    from cloudml_lib.base.resources import measured

    choice = ((measured("memory_format") or {}).get("channels_last") or {}).get(device.type)
    speedup = choice.get("speedup") if isinstance(choice, dict) else None
    if not isinstance(speedup, (int, float)) or isinstance(speedup, bool) or not 0.1 <= speedup <= 10:
        return False, f"the default (channels_last was not measured on a {device.type})"
    use = choice.get("use") is True
    return use, (
        f"{'channels_last' if use else 'the default'}; channels_last measured {speedup:.2f}x the default's "
        f"training steps on a {device.type} (benchmarks/results/memory_format.json)"
    )
