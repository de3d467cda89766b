"""Failures a run recovers from instead of crashing: GPU out-of-memory, a broken torch.compile.

The Trainer wraps each batch in `run_attempt`. Before an attempt, `capture_undo` keeps what the
attempt could change (BatchNorm buffers, the RNG, gradients accumulated so far); after a failure
`undo` puts them back, so the redone batch counts once and a later resume stays bit-exact. Out of
memory halves the micro-batch (training) or the evaluation batch (validation); a compile failure
switches to the eager model. (A NaN/inf loss, which skips the step and checks the cache for bit rot, is
the trainer's: train/nonfinite.py; this module reads no data.)
"""

from __future__ import annotations

import gc
import logging

import torch

from cloudml_lib.base.errors import CloudMLError

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 16  # recoveries of one step: halvings of the micro-batch, one fall-back to eager


def run_attempt(fn, compiled: bool):
    """(fn(), None); or (None, "oom") on GPU out-of-memory; or (None, what failed) when the compiled
    model failed. Errors of the eager model propagate. Returning from the handler releases the
    traceback, which would otherwise pin the failed attempt's tensors during the recovery."""
    try:
        return fn(), None
    except torch.cuda.OutOfMemoryError:
        return None, "oom"
    except Exception as e:  # noqa: BLE001 - only a compiled model's failures are recovered
        if not compiled:
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return None, f"{type(e).__name__}: {first}"


def capture_undo(model: torch.nn.Module, device: torch.device, keep_grads: bool) -> dict:
    """What a failed attempt could change: BatchNorm buffers, RNG, gradients accumulated so far."""
    return {
        "buffers": [b.clone() for b in model.buffers()],
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if device.type == "cuda" else None,
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        if keep_grads
        else None,
    }


def undo(before: dict, model: torch.nn.Module, optimizer, device: torch.device) -> None:
    with torch.no_grad():
        for b, saved in zip(model.buffers(), before["buffers"]):
            b.copy_(saved)
    torch.set_rng_state(before["rng"])
    if before["cuda_rng"] is not None:
        torch.cuda.set_rng_state(before["cuda_rng"])
    if before["grads"] is None:
        optimizer.zero_grad(set_to_none=True)
    else:
        for p, g in zip(model.parameters(), before["grads"]):
            p.grad = g
    release_memory(device)


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def halve_micro_batch(state, batch_len: int, batch_size: int) -> None:
    """Out of memory in training: the next attempt runs in micro-batches of half the size."""
    current = min(state.micro_batch_size, batch_len)
    if current <= 1:
        raise CloudMLError(
            "GPU out of memory even with micro-batches of one sample. Use preset C "
            "(model.memory_optimized: true), turn on model.gradient_checkpointing, or set data.downsample: "
            "2; "
            "the last checkpoint is intact, so the run resumes from there."
        )
    state.micro_batch_size = max(1, current // 2)
    state.oom_recoveries += 1
    log.warning(
        "GPU out of memory at step %d: redoing the batch in micro-batches of %d (batch size %d and "
        "learning rate unchanged). To avoid the retry, set train.batch_size to %d or use "
        "train.batch_size: auto.",
        state.step,
        state.micro_batch_size,
        batch_size,
        state.micro_batch_size,
    )


def halve_eval_batch(batch: int) -> int:
    """Out of memory in evaluation: fewer samples at a time for the rest of the run; returns the new batch."""
    if batch <= 1:
        raise CloudMLError(
            "GPU out of memory during validation even one sample at a time; use preset C "
            "or data.downsample: 2"
        )
    log.warning(
        "GPU out of memory during validation: evaluating %d samples at a time from now on", batch // 2
    )
    return batch // 2


def eager_after_compile_failure(model: torch.nn.Module, watch, failure: str) -> torch.nn.Module:
    """The forward to use from now on: the plain model, its compiled encoder undone (compile.undo_compile)."""
    from cloudml_lib.core.network.compile import undo_compile, unwrap_model

    log.warning(
        "torch.compile failed (%s). Continuing in eager mode from the same step; nothing is lost. "
        "Set train.torch_compile: false to skip compiling next time.",
        failure,
    )
    undo_compile(unwrap_model(model), watch, failure)
    return model


def refuse_retry_across_processes(dist, failure: str, step: int) -> None:
    """With several processes a failed step is not redone: the others are inside its collectives."""
    if dist.active:
        raise CloudMLError(
            f"process {dist.rank} of {dist.world} failed in training step {step} ({failure}); with several "
            "processes this is not retried. "
            + (
                "Lower train.batch_size (the global batch), "
                if failure == "oom"
                else "Set train.torch_compile: false, "
            )
            + "then run the same command to resume."
        )
