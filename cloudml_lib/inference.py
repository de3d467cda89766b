"""A trained model over many windows in eval mode, each frame encoded once.

In eval mode a frame's encoding does not depend on the other frames of its batch (BatchNorm uses its
running statistics), so the T encodings a window needs are the per-frame encodings of its frames.
Consecutive windows share frames: a whole flight predicted with one window per frame holds every frame
in T windows. Here each frame is encoded once, in batches of as many frames as the per-window path put
through the encoder at a time (one frame of each of `window_batch` windows: the same activation memory),
and each window's head reads the T encodings it needs (model.pool_frames, then model.output). The encodings of
a flight are C floats per frame, so host memory stays small however long the flight.

- `encode_frames`: frames -> encodings, in fixed-size batches (the last one padded, so that a compiled
  encoder meets one shape), under torch.inference_mode and the model's autocast.
- `windows_forward`: encodings + the (N, T) rows of each window + its angles -> the model's outputs.
- `dataset_outputs`: the same for samples of a CloudDataset (label-centred windows from the cache): the
  distinct frames of the windows asked for are encoded once (T = 7 windows share about a quarter of their
  frames; T = 3 and 5 hardly any).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import numpy as np
import torch

from cloudml_lib.errors import CloudMLError
from cloudml_lib.model import Outputs

log = logging.getLogger(__name__)

HEAD_BATCH = 4096  # windows per head call: the head is a few small layers on C + 3 numbers


def encode_frames(
    model, frames: np.ndarray, device: torch.device, batch: int, autocast=nullcontext
) -> np.ndarray:
    """(N, H, W) frames -> (N, C) float32 encodings, `batch` frames at a time. A compiled encoder (compiled
    in place, with static shapes: compile.py) gets every batch padded to `batch`, so it meets one shape."""
    out = np.empty((len(frames), model.feature_width), np.float32)
    compiled = "forward" in vars(getattr(model, "encoder", object()))
    with torch.inference_mode():
        for i in range(0, len(frames), batch):
            chunk = torch.from_numpy(np.ascontiguousarray(frames[i : i + batch], np.float32)).to(device)
            n = len(chunk)
            if n < batch and compiled:
                chunk = torch.cat([chunk, chunk.new_zeros((batch - n,) + tuple(chunk.shape[1:]))])
            with autocast():
                encoded = model.encode_frames(chunk)  # (batch, C)
            out[i : i + n] = encoded[:n].float().cpu().numpy()
    return out


class StreamEncoder:
    """encode_frames for a stream of frames (predict): on GPU out-of-memory the batch is halved, for the rest
    of the stream, and the frames are encoded again (a frame's encoding does not depend on its batch)."""

    def __init__(self, model, device: torch.device, batch: int, autocast=nullcontext):
        self.model, self.device, self.batch, self.autocast = model, device, max(1, batch), autocast

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        while True:
            try:
                return encode_frames(self.model, frames, self.device, self.batch, self.autocast)
            except torch.cuda.OutOfMemoryError:
                if self.batch <= 1:
                    raise CloudMLError(
                        "GPU out of memory encoding one frame at a time; free the GPU (other "
                        "notebooks or processes hold its memory) or predict on the CPU"
                    ) from None
                self.batch //= 2
                torch.cuda.empty_cache()
                log.warning(
                    "GPU out of memory while predicting: encoding %d frames at a time from now on (the "
                    "numbers do not change)",
                    self.batch,
                )


def to_numpy(out: Outputs) -> dict:
    """A batch's Outputs as float32 arrays by name (None where the model has no such output)."""
    return {k: None if v is None else v.float().cpu().numpy() for k, v in out._asdict().items()}


def concat(parts: list[dict]) -> dict:
    """Outputs of consecutive batches (to_numpy's dicts) as one dict of arrays; an empty list: zero rows."""
    if not parts:
        return {k: np.zeros(0, np.float32) for k in Outputs._fields}
    return {k: None if parts[0][k] is None else np.concatenate([p[k] for p in parts]) for k in parts[0]}


def windows_forward(
    model,
    encodings: np.ndarray,
    rows: np.ndarray,
    scalars: np.ndarray,
    device: torch.device,
    autocast=nullcontext,
    features: bool = False,
) -> dict | np.ndarray:
    """The model's outputs by name (to_numpy; with `features`, the head's input, an (N, C + 3) array) for N
    windows whose frames are rows (N, T) of `encodings`, with their angles `scalars` (N, 3)."""
    outs = []
    with torch.inference_mode():
        for i in range(0, len(rows), HEAD_BATCH):
            feats = torch.from_numpy(encodings[rows[i : i + HEAD_BATCH]]).to(device)  # (B, T, C)
            s = torch.from_numpy(np.ascontiguousarray(scalars[i : i + HEAD_BATCH], np.float32)).to(device)
            with autocast():
                pooled = model.pool_frames(feats, s)
                outs.append(pooled.float().cpu().numpy() if features else to_numpy(model.output(pooled)))
    if features:
        return np.concatenate(outs) if outs else np.zeros((0, model.feature_width + 3), np.float32)
    return concat(outs)


def dataset_outputs(
    model,
    dataset,
    indices: np.ndarray,
    device: torch.device,
    window_batch: int,
    autocast=nullcontext,
    features: bool = False,
) -> tuple[dict | np.ndarray, np.ndarray]:
    """(outputs by name, or with `features` the head's input; standardised targets) for samples `indices` of a
    CloudDataset without augmentation, in order: the frames of their windows read from the cache and encoded
    once per flight."""
    indices = np.asarray(indices, np.int64)
    scalars, targets = dataset.inputs(indices)
    parts = {}
    for k, cache in enumerate(dataset.caches):
        mine = np.flatnonzero(dataset.flight_of[indices] == k)
        if not len(mine):
            continue
        windows = cache.windows[dataset.local[indices[mine]]]  # (n, T) cache rows
        batch = window_batch
        needed, rows = np.unique(windows, return_inverse=True)  # each distinct frame once, in order
        encodings = np.empty((len(needed), model.feature_width), np.float32)
        for i in range(0, len(needed), batch):  # a batch of frames in memory at a time
            encodings[i : i + batch] = encode_frames(
                model, cache.frames.read(needed[i : i + batch]), device, batch, autocast
            )
        parts[k] = (
            mine,
            windows_forward(
                model, encodings, rows.reshape(windows.shape), scalars[mine], device, autocast, features
            ),
        )
    order = np.argsort(
        np.concatenate([m for m, _ in parts.values()] or [np.zeros(0, np.int64)]), kind="stable"
    )
    if features:
        out = (
            np.concatenate([r for _, r in parts.values()])
            if parts
            else np.zeros((0, model.feature_width + 3))
        )
        return out[order].astype(np.float64), targets.astype(np.float64)
    out = concat([r for _, r in parts.values()])
    return {k: None if v is None else v[order].astype(np.float64) for k, v in out.items()}, targets.astype(
        np.float64
    )


def prepare_model(model, device: torch.device, channels_last: bool | None = None) -> bool:
    """A loaded model made ready for inference: in channels_last memory format where the predict benchmark
    measured it to pay on this kind of device (benchmarks/predict.py; `channels_last` forces the choice).
    The numbers are the same to float rounding. Returns whether channels_last is used."""
    if channels_last is None:
        from cloudml_lib.resources import measured

        choice = ((measured("predict") or {}).get("channels_last") or {}).get(device.type) or {}
        channels_last = bool(choice.get("use", False))
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return channels_last
