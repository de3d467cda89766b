"""When the loop's state is committed and what goes with it: the cadence (every N steps, every N
minutes, each epoch's end), the manifest a human reads, the stop when saves keep failing, and best.pt."""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from cloudml_lib.checkpoint import FORMAT_VERSION, CheckpointWriter, save_atomic, to_cpu, unwrap_model
from cloudml_lib.config import CheckpointConfig, Config
from cloudml_lib.distributed import Dist
from cloudml_lib.errors import CloudMLError

MAX_FAILED_SAVES = 3          # checkpoints in a row that could not be written before training stops


class Checkpoints:
    """Rank 0's background writer, the time of the last save, and how long each save stalled the loop
    (`stalls`, in seconds; the benchmarks read it)."""

    def __init__(self, run_dir: Path, cfg: CheckpointConfig, dist: Dist):
        self.run_dir, self.cfg = run_dir, cfg
        self.writer = CheckpointWriter(run_dir, cfg.keep_last) if dist.is_main else None
        self.stalls: list[float] = []
        self.last_save = time.monotonic()

    def due(self, step: int) -> tuple[bool, bool]:
        """(by steps, by this process's clock): the clocks of several processes are agreed on by the caller."""
        return step % self.cfg.every_steps == 0, time.monotonic() - self.last_save >= 60 * self.cfg.every_minutes

    def commit(self, state: dict, meta: dict | None, wait: bool, t0: float, before=None) -> float:
        """Hand rank 0's snapshot to the writer (others pass meta None); returns the stall since `t0`.
        After MAX_FAILED_SAVES failed saves in a row training stops: work that cannot be saved is at risk."""
        if self.writer is None:
            self.last_save = time.monotonic()
            return 0.0
        if self.writer.failures_in_a_row >= MAX_FAILED_SAVES:
            self.writer.wait()
            raise CloudMLError(
                f"{self.writer.failures_in_a_row} checkpoints in a row could not be written to "
                f"{self.run_dir / 'checkpoints'} ({self.writer.last_error}). Training stops so that no more work goes "
                "unsaved. Free space there or make it writable, then run the same command again to resume from "
                "the last checkpoint that was written.")
        self.writer.submit(state, meta, wait=wait, before=before)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_save = time.monotonic()
        return stall

    def close(self, events=None) -> None:
        """Let an in-flight checkpoint finish (it may be copying the events), then commit the events."""
        if self.writer is not None:
            self.writer.wait()
        if events is not None:
            events.close()
        if self.writer is not None:
            self.writer.close()


def manifest(st: dict, cfg: Config, batches_per_epoch: int, samples_in_epoch: int, total_steps: int,
             reason: str) -> dict:
    """meta.json: where the run is, in words a person (and `status`) reads without loading the state."""
    best = next((h for h in st["history"] if h["epoch"] == st["best_epoch"]), None)
    return {"step": st["step"], "epoch": st["epoch"], "batch": st["batch"], "samples_in_epoch": samples_in_epoch,
            "epochs": cfg.train.epochs, "batches_per_epoch": batches_per_epoch, "total_steps": total_steps,
            "finished": st["finished"], "stopped_early": st["stopped_early"], "run_id": st["run_id"],
            "reason": reason, "best_metric": st["best_val_loss"] if math.isfinite(st["best_val_loss"]) else None,
            "best_r2": best["r2"] if best else None, "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def save_checkpoint(tr, reason: str, wait: bool) -> float:
    """The Trainer's state snapshotted now (a step boundary) and committed in the background;
    returns how long the loop stalled."""
    t0 = time.perf_counter()
    snap = tr.snapshot()                                 # every rank: the snapshot gathers from all of them
    st = tr.state
    meta = manifest(st, tr.cfg, tr.sampler.batches_per_epoch(), tr.sampler.samples_before(st["batch"]),
                    tr.total_steps, reason)
    marks = tr.events.mark()                             # the events up to this step go first (events.py)
    return tr.checkpoints.commit(snap, meta, wait, t0, before=lambda: tr.events.commit(marks))


def save_best(tr) -> None:
    """best.pt: the weights and what evaluating or predicting with them needs (no optimizer)."""
    st = tr.state
    save_atomic({"format": FORMAT_VERSION, "model": to_cpu(dict(unwrap_model(tr.model).state_dict())),
                 "config": tr.cfg.to_dict(), "scalers": tr.val_set.scalers.to_dict(), "epoch": st["best_epoch"],
                 "step": st["step"], "val_loss": st["best_val_loss"],
                 "train_mean_km": float(np.nanmean(tr.train_set.targets_km())), "provenance": tr.provenance},
                tr.run_dir / "best.pt")
