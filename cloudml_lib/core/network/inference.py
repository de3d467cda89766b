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
- `predict`: a dataset's outputs in eval mode, each frame once, or window by window where the dataset
  augments (its windows differ from its frames).
- `Evaluator`: `predict` over the processes of a run, with evaluation's recoveries (out of GPU memory halves
  its batch; a compile failure falls back to eager): what each epoch's validation and the end of a run use.
- `eval_batch_size`: the one rule for how many windows an evaluation takes at a time.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

from cloudml_lib.base import liveness
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.core.network.compile import unwrap_model
from cloudml_lib.core.network.model import Outputs
from cloudml_lib.core.network.recovery import MAX_ATTEMPTS, halve_eval_batch, release_memory, run_attempt
from cloudml_lib.data.dataset import CloudDataset

log = logging.getLogger(__name__)

HEAD_BATCH = 4096  # windows per head call: the head is a few small layers on C + 3 numbers


def aligned(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a float32 tensor in memory of torch's own (on the CPU a copy, aligned as every tensor torch
    allocates): a view of NumPy's memory starts wherever NumPy's allocator put it, and a math library may
    take another path, with other roundings, for another alignment; the same numbers then give the same
    outputs in any process (a resumed run's end agrees with the run never stopped)."""
    return torch.tensor(np.asarray(array, np.float32), device=device)


def encode_frames(
    model, frames: np.ndarray, device: torch.device, batch: int, autocast=nullcontext
) -> np.ndarray:
    """(N, H, W) frames -> (N, C) float32 encodings, `batch` frames at a time. A compiled encoder (compiled
    in place, with static shapes: compile.py) gets every batch padded to `batch`, so it meets one shape."""
    out = np.empty((len(frames), model.feature_width), np.float32)
    compiled = "forward" in vars(getattr(model, "encoder", object()))
    with torch.inference_mode():
        for i in range(0, len(frames), batch):
            chunk = aligned(frames[i : i + batch], device)
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
            feats = aligned(encodings[rows[i : i + HEAD_BATCH]], device)  # (B, T, C)
            s = aligned(scalars[i : i + HEAD_BATCH], device)
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
        from cloudml_lib.base.resources import measured

        choice = ((measured("predict") or {}).get("channels_last") or {}).get(device.type) or {}
        channels_last = bool(choice.get("use", False))
    if channels_last:
        model.to(memory_format=torch.channels_last)
    return channels_last


def predict(
    model,
    dataset: CloudDataset,
    device: torch.device,
    batch_size: int,
    autocast=nullcontext,
    indices: np.ndarray | None = None,
    num_workers: int = 0,
    features: bool = False,
) -> tuple[dict | np.ndarray, np.ndarray]:
    """Model outputs by name (inference.to_numpy: standardised `height`, `cloud_logit` or None; with
    `features`, the head's input, an (N, C + 3) array) and standardised targets for `indices` of `dataset`
    (all by default), in order.

    `model` is the module (put in eval mode meanwhile). Each distinct frame of the windows is encoded once
    (inference.py), `batch_size` windows' worth of frames at a time. A dataset with augmentation (whose
    windows differ from their frames) goes window by window, with `num_workers` loader processes.
    Eight parameters, each a choice of this one call (what, where, how much at a time, which output): the
    Evaluator holds them for a run, so that every other caller passes few."""
    was_training = model.training
    model.eval()
    try:
        indices = np.arange(len(dataset)) if indices is None else np.asarray(indices, np.int64)
        if not dataset.augment:
            return dataset_outputs(model, dataset, indices, device, batch_size, autocast, features)
        return _window_by_window(
            model.features if features else model,
            dataset,
            device,
            batch_size,
            autocast,
            indices,
            num_workers,
        )
    finally:
        model.train(was_training)


@torch.inference_mode()
def _window_by_window(forward, dataset, device, batch_size, autocast, indices, num_workers):
    loader = DataLoader(
        Subset(dataset, indices.tolist()), batch_size=batch_size, shuffle=False, num_workers=num_workers
    )
    preds, targets = [], []
    for batch in loader:
        with autocast():
            out = forward(
                batch["frames"].to(device, non_blocking=True), batch["scalars"].to(device, non_blocking=True)
            )
        preds.append(out.float().cpu().numpy() if isinstance(out, torch.Tensor) else to_numpy(out))
        targets.append(batch["target"].numpy())
    target = np.concatenate(targets).astype(np.float64) if targets else np.zeros(0)
    if preds and isinstance(preds[0], np.ndarray):  # features
        return np.concatenate(preds).astype(np.float64), target
    return {k: None if v is None else v.astype(np.float64) for k, v in concat(preds).items()}, target


def eval_batch_size(train_batch: int) -> int:
    """Windows evaluated at a time: twice the training batch (no gradients or optimizer state to hold); out of
    memory halves it from there (Evaluator)."""
    return 2 * int(train_batch)


class Evaluator:
    """The model's outputs on the samples of a dataset, in eval mode, each process computing its share. Out
    of GPU memory halves the evaluation batch (`self.batch`, kept for the rest of the run: its owner saves
    it); a compiled encoder that fails calls `on_compile_failure` (the Trainer switches to eager) and the
    batch is redone. The results do not depend on the evaluation batch size."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        autocast,
        dist,
        batch: int,
        num_workers: int = 0,
        on_compile_failure=None,
    ):
        self.model, self.device, self.autocast, self.dist = unwrap_model(model), device, autocast, dist
        self.batch, self.num_workers, self.on_compile_failure = batch, num_workers, on_compile_failure

    @property
    def compiled(self) -> bool:
        """The encoder is compiled in place (compile.apply_compile) and not undone."""
        return "forward" in vars(getattr(self.model, "encoder", object()))

    def outputs(
        self, dataset: CloudDataset, indices: np.ndarray, features: bool = False
    ) -> tuple[dict | np.ndarray, np.ndarray]:
        """The model's outputs by name (or, with `features`, the head's input) and the standardised targets of
        `indices` of `dataset`, in order, on every process."""
        mine = indices[self.dist.shard(len(indices))]
        liveness.beat()
        for _ in range(MAX_ATTEMPTS):
            result, failure = run_attempt(
                lambda: predict(
                    self.model, dataset, self.device, self.batch, self.autocast, mine, self.num_workers,
                    features=features,
                ),
                self.compiled,
            )  # fmt: skip
            if failure is None:
                return _gathered(self.dist.gather(result), features)
            release_memory(self.device)
            if failure == "oom":
                self.batch = halve_eval_batch(self.batch)
            elif self.on_compile_failure is not None:
                self.on_compile_failure(failure)
        raise CloudMLError("evaluation kept failing after every recovery was tried; see the log above")


def _gathered(parts: list, features: bool) -> tuple[dict | np.ndarray, np.ndarray]:
    """Each process's (outputs, targets), in rank order, as one."""
    targets = np.concatenate([t for _, t in parts])
    if features:
        return np.concatenate([o for o, _ in parts]), targets
    first = parts[0][0]
    return {k: None if first[k] is None else np.concatenate([o[k] for o, _ in parts]) for k in first}, targets
