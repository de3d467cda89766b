"""What a checkpoint file holds, how it is written atomically and how it is loaded safely.

Checkpoints hold only tensors and plain Python types, so they load with
`torch.load(..., weights_only=True)`: a file cannot run code when it is opened. Weights always come
from the unwrapped module (no `_orig_mod.` prefix from torch.compile) and are copied to the CPU
tensor by tensor, never by moving the model off its device.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from cloudml_lib.errors import CloudMLError

FORMAT_VERSION = 1


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside torch.compile / DataParallel wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        else:
            return model


def cpu_state_dict(model: nn.Module) -> dict:
    """A CPU copy of the weights; the model's own parameters stay where they are."""
    return {k: v.detach().to("cpu", copy=True) for k, v in unwrap_model(model).state_dict().items()}


def save_atomic(obj: dict, path: str | Path) -> None:
    """Write to a temporary file in the same folder, flush to disk, then rename into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_checkpoint(path: str | Path) -> dict:
    """Load a checkpoint without unpickling arbitrary objects; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise CloudMLError(f"checkpoint not found: {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure here means the file cannot be trusted
        raise CloudMLError(f"{path} is not a loadable CloudML checkpoint ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "config" not in ckpt:
        raise CloudMLError(f"{path} is not a CloudML checkpoint (no 'model' and 'config' entries)")
    return ckpt
