"""Failures a run recovers from instead of crashing: GPU out-of-memory, a broken torch.compile.

The Trainer wraps each batch in `run_attempt`. Before an attempt, `capture_undo` keeps what the
attempt could change (BatchNorm buffers, the RNG, gradients accumulated so far); after a failure
`undo` puts them back, so the redone batch counts once and a later resume stays bit-exact. Out of
memory halves the micro-batch (training) or the evaluation batch (validation); a compile failure
switches to the eager model. A NaN/inf loss skips the step (`count_nonfinite_step`), and the first
one checks the cache for bit rot.
"""

from __future__ import annotations

import gc
import logging
import time

import torch

from cloudml_lib.base.errors import CloudMLError, DataError
from cloudml_lib.data.cachefiles import verify_cache

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


def count_nonfinite_step(st, train, caches: list, caches_checked: bool) -> bool:
    """A skipped NaN/inf step counted and said; the caches checked the first time (returns True once they
    were); training stopped after train.max_nonfinite_steps in a row."""
    st.nonfinite_in_a_row += 1
    st.nonfinite_total += 1
    log.warning(
        "Non-finite loss at step %d (epoch %d, batch %d): step skipped, weights unchanged (%d in a row, "
        "%d in all).",
        st.step,
        st.epoch + 1,
        st.batch,
        st.nonfinite_in_a_row,
        st.nonfinite_total,
    )
    if not caches_checked:
        check_caches_intact(caches)
    if st.nonfinite_in_a_row >= train.max_nonfinite_steps:
        raise CloudMLError(
            f"training stopped: {train.max_nonfinite_steps} optimizer steps in a row had a NaN or infinite "
            "loss "
            f"(train.max_nonfinite_steps). The preprocessing cache was checked against its checksums and is "
            "intact, so the data did not change; the weights were never updated with those steps, and "
            "best.pt "
            f"and the checkpoints hold finite models. Lower train.learning_rate (now "
            f"{train.learning_rate}), then run the same command to resume from the last checkpoint."
        )
    return True


def check_caches_intact(caches: list) -> None:
    """A NaN loss can come from bit rot in the cache rather than the optimisation: every cache is
    checked against the checksum recorded when it was built (same files on every process, so all
    take the same decision)."""
    t0 = time.time()
    problems = [p for p in map(verify_cache, caches) if p]
    if problems:
        raise DataError(
            "NaN/inf losses: " + "; ".join(problems) + ". Delete the named cache folder(s): they are "
            "rebuilt from the IR files at the next start. Then run the same command again: training "
            "resumes from the last checkpoint, whose weights are finite."
        )
    log.info(
        "The preprocessing cache matches its checksums (checked in %.1f s): the data is intact",
        time.time() - t0,
    )
