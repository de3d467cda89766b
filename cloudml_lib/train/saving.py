"""The run's checkpoints: when the loop's state is committed (every N steps, every N minutes, each epoch's
end), the whole save in one call (snapshot, manifest, the TensorBoard events before it, the background
commit), the stop when saves keep failing, and best.pt. The loop calls `save_if_due` after each step and
`save` at an epoch's end or a stop (then `say_stopped`: what the stop saved, as it is on disk); nothing else
of saving is its concern."""

from __future__ import annotations

import functools
import logging
import math
import time

import torch

from cloudml_lib.base.config import Config
from cloudml_lib.base.errors import TransientError
from cloudml_lib.core.machine.distributed import Dist
from cloudml_lib.core.network.compile import unwrap_model
from cloudml_lib.core.run.checkpoint import (
    FORMAT_VERSION,
    CheckpointWriter,
    Key,
    newest_committed_step,
    previous_checkpoint_words,
    save_atomic,
    to_cpu,
)
from cloudml_lib.core.run.events import Events
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import MetricsFile
from cloudml_lib.train.state import Progress, TrainingState

log = logging.getLogger(__name__)

MAX_FAILED_SAVES = 3  # checkpoints in a row that could not be written before training stops


class Checkpoints:
    """Rank 0's background writer and the run's save cadence, over the TrainingState a checkpoint is made of
    (train/state.py), metrics.jsonl (its length goes into the header) and, once opened, TensorBoard's events
    (committed before each checkpoint). `stalls`: how long each save held the loop, in seconds (the
    benchmarks read it)."""

    def __init__(
        self,
        folder: RunFolder,
        cfg: Config,
        dist: Dist,
        writer: CheckpointWriter | None,
        state: TrainingState,
        metrics: MetricsFile,
        total_steps: int,
    ):
        self.folder, self.cfg, self.dist, self.writer = folder, cfg, dist, writer
        self.state, self.metrics, self.total_steps = state, metrics, total_steps
        self.events: Events | None = None  # opened once the resume point is known (build.py)
        self.stalls: list[float] = []
        self.last_save = time.monotonic()

    @property
    def progress(self) -> Progress:
        return self.state.progress

    @property
    def sampler(self):
        return self.state.sampler

    def snapshot(self) -> dict:
        """The state a resume needs, as CPU copies (collective: every process calls it; rank 0 gets it)."""
        return self.state.snapshot({Key.CONFIG: self.cfg.to_dict(), Key.METRICS_BYTES: self.metrics_bytes()})

    def metrics_bytes(self) -> int:
        return self.metrics.size() if self.dist.is_main else 0

    def save_if_due(self, step: int) -> bool:
        """After an optimizer step: save when N steps or N minutes have passed (the processes agree on the
        clock), except on an epoch's last batch, which is saved right after its validation (the same step)."""
        by_steps = step % self.cfg.checkpoint.every_steps == 0
        by_time = time.monotonic() - self.last_save >= 60 * self.cfg.checkpoint.every_minutes
        by_time = self.dist.any_true(by_time, device=self.state.pieces[Key.LOOP].device)[0]
        if not (by_steps or by_time) or self.progress.batch >= self.sampler.batches_per_epoch():
            return False
        self.save("every_steps" if by_steps else "every_minutes")
        return True

    def save(self, reason: str, wait: bool = False) -> float:
        """Snapshot now (a step boundary), write the manifest, and commit in the background after the events
        up to this step; returns how long the loop stalled. After MAX_FAILED_SAVES failed saves in a row
        training stops: work that cannot be saved is at risk."""
        t0 = time.perf_counter()
        state = self.snapshot()  # every rank: the snapshot gathers from all of them
        if self.writer is None:
            self.last_save = time.monotonic()
            return 0.0
        if self.writer.failures_in_a_row >= MAX_FAILED_SAVES:
            self.writer.wait()
            step = newest_committed_step(self.folder)
            resume = (
                f"to resume from the last checkpoint that was written (step {step})"
                if step is not None
                else "(no checkpoint of this run was written: it starts again from the beginning)"
            )
            raise TransientError(
                f"{self.writer.failures_in_a_row} checkpoints in a row could not be written to "
                f"{self.folder.checkpoints} ({self.writer.last_error}). Training stops so that no more "
                f"work goes unsaved. Free space there or make it writable, then run the same command again "
                f"{resume}."
            ) from self.writer.last_exception
        events = self.events
        # the events up to this step go first
        commit_events = functools.partial(events.commit, events.mark()) if events else None
        self.writer.submit(state, self.manifest(reason), wait=wait, before=commit_events)
        stall = time.perf_counter() - t0
        self.stalls.append(stall)
        self.last_save = time.monotonic()
        return stall

    def say_stopped(self, name: str) -> str:
        """After the stop's save (waited for): where the run can continue from, as it is on disk. A save that
        failed is a problem (red in the notebook), never "checkpoint saved". Returns it in a few words."""
        step = self.progress.step
        if self.failed_last is None:
            log.info(  # the stop was asked for and its progress is saved: words, not a warning
                "Stopped by %s at step %d; checkpoint saved in %s. Run the same command again to resume.",
                name,
                step,
                self.folder.checkpoints,
            )
            return "progress saved"
        log.error(
            "Stopped by %s at step %d, but its checkpoint could not be written (%s); %s",
            name,
            step,
            self.failed_last,
            previous_checkpoint_words(self.folder),
        )
        return "its checkpoint could not be written"

    def manifest(self, reason: str) -> dict:
        """meta.json: where the run is, in words a person (and `status`) reads without loading the state."""
        st = self.progress
        best = next((h for h in st.history if h["epoch"] == st.best_epoch), None)
        return {
            "step": st.step,
            "epoch": st.epoch,
            "batch": st.batch,
            "samples_in_epoch": self.sampler.samples_before(st.batch),
            "epochs": self.cfg.train.epochs,
            "batches_per_epoch": self.sampler.batches_per_epoch(),
            "total_steps": self.total_steps,
            "finished": st.trained,  # the key every release wrote
            "stopped_early": st.stopped_early,
            "run_id": st.run_id,
            "reason": reason,
            "best_metric": st.best_val_loss if math.isfinite(st.best_val_loss) else None,
            "best_r2": best["r2"] if best else None,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def save_best(self, model: torch.nn.Module, train_mean_km: float) -> None:
        """best.pt (rank 0): the weights and what evaluating or predicting with them needs (no optimizer)."""
        if not self.dist.is_main:
            return
        st = self.progress
        save_atomic(
            {
                Key.FORMAT: FORMAT_VERSION,
                Key.MODEL: to_cpu(dict(unwrap_model(model).state_dict())),
                Key.CONFIG: self.cfg.to_dict(),
                Key.SCALERS: self.state.header[Key.SCALERS],
                Key.EPOCH: st.best_epoch,
                Key.STEP: st.step,
                Key.VAL_LOSS: st.best_val_loss,
                Key.TRAIN_MEAN_KM: float(train_mean_km),
                Key.PROVENANCE: self.state.header[Key.PROVENANCE],
                Key.LABEL_RANGE: self.state.header[Key.LABEL_RANGE],
                Key.SPLIT: self.state.header[Key.SPLIT],
                **{k: self.state.header[k] for k in (Key.DOMAIN,) if k in self.state.header},
            },
            self.folder.best,
        )

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    @property
    def failed_last(self) -> str | None:
        """Why the newest save failed, if it did (rank 0; None elsewhere or when it was written)."""
        return self.writer.last_error if self.writer is not None and self.writer.failures_in_a_row else None

    def close(self) -> None:
        """Let an in-flight checkpoint finish (it may be copying the events), then commit the events."""
        self.wait()
        if self.events is not None:
            self.events.close()
        if self.writer is not None:
            self.writer.close()
