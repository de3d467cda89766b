"""The machine: which device to train on and with which precision."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cloudml_lib.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Precision:
    """Autocast dtype (None: full fp32) and whether fp16 loss scaling is needed."""
    dtype: torch.dtype | None
    use_grad_scaler: bool

    @property
    def name(self) -> str:
        return {None: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.dtype]


def choose_device(preference: str = "auto") -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device: 'cuda' was asked for but no CUDA GPU is visible; use 'auto' or 'cpu' "
                          "(on Colab: Runtime > Change runtime type > GPU)")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def choose_precision(device: torch.device) -> Precision:
    """fp16 + GradScaler before compute capability 8 (T4, V100), bf16 from 8 (A100, H100), fp32 on CPU."""
    if device.type != "cuda":
        return Precision(None, False)
    major, _ = torch.cuda.get_device_capability(device)
    return Precision(torch.bfloat16, False) if major >= 8 else Precision(torch.float16, True)


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return f"{p.name} ({p.total_memory / 2**30:.1f} GiB, compute capability {p.major}.{p.minor})"
    return f"CPU ({torch.get_num_threads()} threads)"
