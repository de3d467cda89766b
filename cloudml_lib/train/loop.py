"""The training loop, top to bottom: fit -> epoch -> step, ending at the final checkpoint. Set-up is
`build.py`, what survives a restart `state.py`, checkpoints `saving.py`, each epoch's validation
`evaluation.py`; this file holds what runs every epoch and step. The end of a run (the test flights'
evaluation of the best model, the cloud probe, the intervals, the report) is a stage of its own,
science/finish.py, which commands/runs.py runs after `fit`.

A step: forward and backward of each batch (micro-batch by micro-batch), the optimizer step once per
train.grad_accum_steps batches, skipped when its loss is NaN/inf; out-of-memory and compile failures
are recovered from (`recovery.py`); then the checkpoint if one is due, and a stop asked for by a signal.
With several processes the loop reads the same: the collectives are `Dist` helpers, no-ops with one.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from cloudml_lib.base import faults, liveness
from cloudml_lib.base.config import Config
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.core.machine.determinism import restore_determinism
from cloudml_lib.core.machine.device import format_memory, memory_readings
from cloudml_lib.core.machine.distributed import SINGLE, Dist, no_sync
from cloudml_lib.core.network.compile import CompileWatch
from cloudml_lib.core.network.inference import Evaluator
from cloudml_lib.core.network.metrics import Scored
from cloudml_lib.core.network.model import MultimodalRegressionModel
from cloudml_lib.core.network.recovery import (
    MAX_ATTEMPTS,
    capture_undo,
    eager_after_compile_failure,
    halve_micro_batch,
    refuse_retry_across_processes,
    run_attempt,
    undo,
)
from cloudml_lib.core.run.events import Events
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import MetricsFile
from cloudml_lib.core.run.runlock import RunLock
from cloudml_lib.data.dataset import CloudDataset, EpochBatchSampler
from cloudml_lib.train.build import build_run, resolved
from cloudml_lib.train.evaluation import update_best, validate
from cloudml_lib.train.loss import global_totals, part_loss
from cloudml_lib.train.nonfinite import count_nonfinite_step
from cloudml_lib.train.progress import ProgressLines, RunInfo, log_step, mean_loss
from cloudml_lib.train.saving import Checkpoints
from cloudml_lib.train.signals import StopRequest
from cloudml_lib.train.state import LoopState, Progress

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        cfg: Config,
        folder: RunFolder | str | Path,
        resume: str = "auto",
        init_from: Path | None = None,
        dist: Dist = SINGLE,
    ):
        """`cfg`: the config as loaded (never changed: the run's resolved plan is `self.cfg` after setup()).
        `folder`: the run folder (a path is taken as one). `init_from`: a best.pt whose weights a new run
        starts from (fine-tuning); ignored on resume. `dist`: this process's place in a torchrun job; only
        rank 0 writes files."""
        self.cfg, self.folder, self.resume, self.init_from, self.dist = (
            cfg,
            RunFolder.of(folder),
            resume,
            init_from,
            dist,
        )
        self.lock: RunLock | None = None
        self.checkpoints: Checkpoints | None = None
        self.stop = StopRequest()
        self.caches_checked = False
        self.progress_lines = ProgressLines(dist.is_main and os.environ.get("CLOUDML_PROGRESS") == "1")

    @property
    def saving(self) -> Checkpoints:
        """The run's checkpoints (set up by setup())."""
        if self.checkpoints is None:
            raise RuntimeError("Trainer.setup() has not run: the run has no checkpoints yet")
        return self.checkpoints

    def setup(self) -> Trainer:
        """The ordered build (build.py): data, run folder, model, precision, compile, DDP, optimizer, loader,
        checkpoints and the resume point; each part is assigned here."""
        run = build_run(self.cfg, self.folder, self.resume, self.init_from, self.dist)
        self.cfg = run.config  # the run's plan: flights and batch size resolved
        self.train_set: CloudDataset = run.train_set
        self.val_set: CloudDataset = run.val_set
        self.quick_val: np.ndarray = run.quick_val
        self.lock = run.lock
        p = run.parts
        self.model: torch.nn.Module = p.model  # the plain module: trained
        self.average = p.average  # the EMA of its weights (train.ema_decay), or None
        # what is validated and kept as best.pt: the average where the run keeps one
        self.evaluated: torch.nn.Module = p.model if p.average is None else p.average.module
        self.ddp: torch.nn.Module = p.ddp  # the model, or DDP around it
        self.forward: Callable = p.ddp  # what a training step calls (eager after a compile failure)
        self.device: torch.device = p.device
        self.autocast: Callable = p.autocast
        self.scaler: torch.amp.GradScaler = p.scaler
        self.compile: CompileWatch = p.compile
        self.optimizer: torch.optim.Optimizer = p.optimizer
        self.scheduler: torch.optim.lr_scheduler.LambdaLR = p.scheduler
        self.sampler: EpochBatchSampler = p.sampler
        self.loader: DataLoader = p.loader
        self.num_workers: int = p.num_workers
        self.steps_per_epoch: int = p.steps_per_epoch
        self.total_steps: int = p.total_steps
        self.loop: LoopState = run.loop
        self.progress: Progress = run.loop.progress  # where the run is: saved in every checkpoint
        self.checkpoints = run.checkpoints
        self.metrics: MetricsFile = run.metrics
        self.run_info: RunInfo = run.run_info
        self.events: Events = run.events
        self.evaluator = Evaluator(
            self.evaluated,
            self.device,
            self.autocast,
            self.dist,
            resolved(self.progress.eval_batch_size, "the evaluation batch size"),
            self.num_workers,
            self._eager_after_compile_failure,
        )
        return self

    # ------------------------------------------------------------------------------ the loop
    def fit(self, after_epoch=None) -> None:
        """Train to the last epoch (or an early stop) and save the final checkpoint: the run is trained. Its
        end (science/finish.py) is not the Trainer's. `after_epoch(history)`: a sweep's pruner, asked after
        each epoch (and at a resumed start) and free to end the run by raising."""
        t, st, after_epoch = self.cfg.train, self.progress, after_epoch or (lambda history: None)
        try:
            if st.trained:
                log.info(
                    "This run is trained (epoch %d/%d); nothing to train. Raise train.epochs to train "
                    "longer, or use another --run-dir for a new run.",
                    st.epoch,
                    t.epochs,
                )
                return
            for model in {id(m): m for m in (self.model, self.evaluated)}.values():
                cast(
                    MultimodalRegressionModel, model
                ).clear_cloud_probe()  # a probe is fitted at the end of the run, not before
            with self.stop.trapped():
                done = st.epoch >= t.epochs
                while True:
                    if st.history:
                        after_epoch(st.history)
                    if done:
                        return self.save_trained()
                    done = self.run_epoch()
        finally:
            self.close()

    def run_epoch(self) -> bool:
        """Train the rest of the current epoch, validate, save; returns True when training should stop."""
        t, st = self.cfg.train, self.progress
        epoch, t0, step0, full = st.epoch, time.time(), st.step, st.batch == 0
        train_loss = self.train_epoch(epoch)
        val_loss, m, _ = self.validate(self.quick_val)
        memory = memory_readings(self.device)
        record = {
            "epoch": epoch + 1,
            "step": st.step,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "r2": m["r2"],
            "mae_km": m["mae_km"],
            "rmse_km": m["rmse_km"],
            "bias_km": m["bias_km"],  # a flight-wide offset moves R2 most (benchmarks/stability.py)
            "cloud_accuracy": m.get("cloud_accuracy"),
            "lr": self.optimizer.param_groups[0]["lr"],
            "time_s": time.time() - t0,
        }
        st.history.append(record)
        self.metrics.append({"kind": "epoch", **record, "memory": memory})
        self.run_info.epoch_done(record["time_s"], st.step - step0, full, memory)
        self.events.epoch(record, format_memory(memory), self.compile.update().describe())
        cloud = "" if m.get("cloud_accuracy") is None else f" | cloud acc {m['cloud_accuracy']:.2f}"
        log.info(
            "Epoch %d/%d | train_loss %.3f | val_loss %.3f | R2 %.2f | MAE %.3f km%s | lr %.1e | %.1f s | %s",
            epoch + 1,
            t.epochs,
            train_loss,
            val_loss,
            m["r2"],
            m["mae_km"],
            cloud,
            record["lr"],
            record["time_s"],
            format_memory(memory),
        )
        stop = self._update_best(val_loss, epoch + 1)
        st.epoch, st.batch, st.stopped_early = epoch + 1, 0, stop
        self.loop.reset_epoch()
        self.run_info.write()  # recompiles for validation show here
        if stop or st.epoch >= t.epochs:
            return True
        self.saving.save("epoch_end")
        if self.dist.any_true(self.stop.asked, device=self.device)[0]:
            self.stop.ask()
            self._stop_now()
        return False

    def train_epoch(self, epoch: int) -> float:
        t, st = self.cfg.train, self.progress
        self.model.train()
        self.sampler.set_epoch(epoch, start_batch=st.batch)
        self.train_set.set_epoch(epoch)
        n_total = self.sampler.batches_per_epoch()
        # Only the other processes are switched off here: on rank 0 tqdm's own TQDM_DISABLE decides (the
        # notebook's subprocess sets it; an explicit disable= would override it and flood the cell).
        bar = tqdm(
            self.loader,
            total=n_total,
            initial=st.batch,
            desc=f"epoch {epoch + 1}/{t.epochs}",
            unit="batch",
            leave=False,
            **({} if self.dist.is_main else {"disable": True}),
        )
        self.loop.window_t0 = time.time()
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for batch in bar:
            loss = self.train_step(batch)
            ok = torch.isfinite(loss)
            finite &= ok
            self.loop.add(loss, ok, len(batch["target"]))  # device-side sums: no sync per batch
            st.batch += 1
            if st.batch % t.grad_accum_steps == 0 or st.batch == n_total:
                # One sync per optimizer step, as a GradScaler has; all processes skip a step together.
                if not self.dist.any_true(not bool(finite), device=self.device)[0]:
                    st.nonfinite_in_a_row = 0
                    self.optimizer_step()
                    if st.step % t.log_every_steps == 0:
                        log_step(self.loop, self.optimizer, self.metrics, self.events, epoch, bar)
                else:
                    self.skip_step()
                    finite.fill_(True)
                self._after_step()
        bar.close()
        return mean_loss(self.dist, self.loop.acc["epoch_loss"], self.loop.acc["epoch_batches"])

    def train_step(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one batch, recovering from GPU out-of-memory and compile failures.

        Out of memory: the batch is redone in micro-batches of half the size (the effective batch
        and the learning rate stay; BatchNorm then normalises each micro-batch on its own), up to
        micro-batches of one sample. A torch.compile failure: the batch is redone in eager mode.
        Either way the attempt's partial effects (gradients, BatchNorm statistics, RNG) are undone
        first, so nothing is counted twice.
        """
        keep_grads = bool(self.progress.batch % self.cfg.train.grad_accum_steps)
        for _ in range(MAX_ATTEMPTS):
            before = capture_undo(self.model, self.device, keep_grads)
            compiled = self.compile.report.active or self.forward is not self.ddp
            loss, failure = run_attempt(lambda: self._forward_backward(batch), compiled)
            if failure is None:
                return loss
            refuse_retry_across_processes(self.dist, failure, self.progress.step)
            undo(before, self.model, self.optimizer, self.device)
            if failure == "oom":
                halve_micro_batch(self.progress, len(batch["target"]), resolved(self.cfg.train.batch_size))
            else:
                self._eager_after_compile_failure(failure)
        raise CloudMLError("a training step kept failing after every recovery was tried; see the log above")

    def _forward_backward(self, batch: dict) -> torch.Tensor:
        """Loss of the whole batch, gradients accumulated micro-batch by micro-batch."""
        t, st = self.cfg.train, self.progress
        n = len(batch["target"])
        # train.last_batch whole: one pass over the whole batch unless out of memory made micro-batches
        # smaller than the batch. The epoch's last batch, with a few samples merged into it
        # (EpochBatchSampler), may exceed batch_size; splitting it there (split, runs before 0.3) can leave
        # a micro-batch of one sample for BatchNorm, what the merge avoids.
        micro = resolved(st.micro_batch_size, "the micro-batch size")
        whole = t.last_batch == "whole" and micro >= resolved(t.batch_size)
        mb = n if whole else micro
        # The weighted mean is over the global batch: each process's gradients are its share of it,
        # scaled by the process count because DDP averages them.
        totals = global_totals(
            {k: batch[k].to(self.device) for k in ("weight", "has_height")}, self.dist.all_sum
        )
        last_of_step = (
            st.batch + 1
        ) % t.grad_accum_steps == 0 or st.batch + 1 == self.sampler.batches_per_epoch()
        total = torch.zeros((), device=self.device)
        for lo in range(0, n, mb):
            part = slice(lo, min(n, lo + mb))
            frames = batch["frames"][part].to(self.device, non_blocking=True)  # (b, T, H, W)
            scalars = batch["scalars"][part].to(self.device, non_blocking=True)  # (b, 3)
            # (b,) each: standardised height, 1 where it has one, cloud flag, sample weight
            labels = {
                k: batch[k][part].to(self.device, non_blocking=True)
                for k in ("target", "has_height", "cloud", "weight")
            }
            # Gradients are averaged across processes once per optimizer step, in its last backward.
            with no_sync(self.ddp, skip=not (last_of_step and lo + mb >= n)):
                with self.autocast():
                    out = self.forward(frames, scalars)
                # This part's share of the batch's weighted means (exactly the means when not split).
                loss = part_loss(
                    out,
                    labels,
                    totals,
                    t.huber_delta,
                    t.hard_example_weight,  # only joint trains
                    t.cloud_loss_weight * (self.cfg.model.cloud_head == "joint"),
                    t.height_loss_weight,
                )
                self.scaler.scale(loss * self.dist.world / t.grad_accum_steps).backward()
            total += loss.detach()
        return total

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        if self.cfg.train.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.average is not None:
            self.average.update(self.model)
        self.progress.step += 1

    def skip_step(self) -> None:
        """A step whose loss was NaN/inf: its gradients are dropped and the weights stay as they were."""
        self.optimizer.zero_grad(set_to_none=True)
        self.caches_checked = count_nonfinite_step(
            self.progress, self.cfg.train, self.train_set.caches + self.val_set.caches, self.caches_checked
        )

    def _after_step(self) -> None:
        """A checkpoint if one is due, the notebook's progress line, the test fault point, a stop asked
        for."""
        st = self.progress
        liveness.beat()
        self.saving.save_if_due(st.step)
        stop = self.dist.any_true(self.stop.asked, device=self.device)[0]  # signals differ between processes
        if stop:
            self.stop.ask()  # maybe another process was asked
        self.progress_lines(st, self.total_steps, self.cfg.train.epochs, self.sampler.batches_per_epoch())
        self.run_info.report_compile()
        faults.point("step", settle=self.saving.wait)
        if stop:
            self._stop_now()

    def _stop_now(self) -> None:
        self.saving.save(self.stop.name, wait=True)
        self.dist.barrier()  # no process leaves before the save is committed
        saved = self.saving.say_stopped(self.stop.name)  # what is on disk, never a false "saved"
        raise KeyboardInterrupt(f"stopped by {self.stop.name}; {saved}")

    def _eager_after_compile_failure(self, failure: str) -> None:
        self.forward = eager_after_compile_failure(self.ddp, self.compile, failure)
        self.run_info.write()

    # ------------------------------------------------------------------------------ scoring
    def validate(self, indices: np.ndarray | None = None) -> tuple[float, dict, Scored]:
        indices = np.arange(len(self.val_set)) if indices is None else indices
        result = validate(self.evaluator, self.val_set, indices, self.cfg)
        self.progress.eval_batch_size = self.evaluator.batch  # halved by out-of-memory: saved with the run
        return result

    def _update_best(self, val_loss: float, epoch: int) -> bool:
        return update_best(
            self.progress,
            val_loss,
            epoch,
            self.evaluated,
            self.cfg.train.early_stopping_patience,
            self.save_best,
            self.folder.best,
        )

    def save_best(self) -> None:
        self.saving.save_best(self.evaluated, float(np.nanmean(self.train_set.targets_km())))

    # ------------------------------------------------------------------------------ the end of training
    def save_trained(self) -> None:
        """The final checkpoint: training is over; a resume of this run goes on to its end
        (science/finish.py)."""
        self.progress.trained = True
        self.saving.save("trained", wait=True)  # every rank: the snapshot gathers from all of them
        self.dist.barrier()
        if self.dist.is_main and self.saving.failed_last:
            raise CloudMLError(
                f"the final checkpoint could not be written ({self.saving.failed_last}): training is "
                "done but not recorded. Free space or fix the folder's permissions, then run the same "
                "command again: it resumes from the last checkpoint that was written."
            )
        log.info(
            "Trained: %d epochs, step %d; best model from epoch %d in %s",
            self.progress.epoch,
            self.progress.step,
            self.progress.best_epoch,
            self.folder.best,
        )

    def close(self) -> None:
        """Let an in-flight checkpoint finish, commit the TensorBoard events, then release the run
        directory and torch's deterministic switches (train.deterministic) as they were before the run."""
        restore_determinism()
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None
