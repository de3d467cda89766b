"""The Trainer: set-up in a fixed order, train_step, validate, fit, checkpoint and resume.

Set-up order matters: seeds before the model is built (initial weights), data before the model
(scalers), the model on its device before torch.compile and before the optimizer is created (the
optimizer must hold the parameters that will be trained, and they are never re-allocated after).
Precision is decided once: autocast and GradScaler are built here, so the loop has no AMP branches
(a disabled GradScaler passes values through unchanged).

Resume is exact: the loop's progress is one dict (`self.state`), the data order is a function of
(seed, epoch) sliced at the saved batch, and every RNG, the optimizer, scheduler and scaler are
restored. A run killed at any moment and resumed ends bit-identical to one never interrupted.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from cloudml_lib import plots
from cloudml_lib.checkpoint import (FORMAT_VERSION, CheckpointWriter, Found, capture_rng, check_folder,
                                    clean_leftovers, cpu_state_dict, fault_point, load_checkpoint, read_meta,
                                    restore_rng, save_atomic, to_cpu)
from cloudml_lib.compile import apply_compile
from cloudml_lib.config import Config, check_pretrain_flight, config_from_dict, save_config
from cloudml_lib.data.cache import verify_cache
from cloudml_lib.data.dataset import EpochBatchSampler, prepare_data, quick_subset
from cloudml_lib.data.flights import prepare_flights
from cloudml_lib.distributed import (SINGLE, Dist, apply_ddp, apply_global_batchnorm, explain_peer_failure,
                                     init_distributed)
from cloudml_lib.errors import CloudMLError, ConfigError, DataError
from cloudml_lib.evaluate import (build_report, format_report, json_safe, predict, regression_metrics,
                                  write_evaluation)
from cloudml_lib.hardware import (choose_device, choose_precision, default_num_workers, describe_device,
                                  format_memory, memory_readings)
from cloudml_lib.model import build_model, count_parameters
from cloudml_lib.outputs import append_text, write_text
from cloudml_lib.provenance import run_provenance, write_run_provenance
from cloudml_lib.recovery import (MAX_ATTEMPTS, capture_undo, eager_after_compile_failure, halve_eval_batch,
                                  halve_micro_batch, measure_batch_size, release_memory, run_attempt, undo)
from cloudml_lib.report import write_report
from cloudml_lib.rundir import (RunLock, attach_run_log, check_data_fingerprint, check_folder_kind, check_resume_config,
                                find_resume_point, truncate_metrics)

log = logging.getLogger(__name__)

MAX_FAILED_SAVES = 3          # checkpoints in a row that could not be written before training stops


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): linear warm-up, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def weighted_huber(pred, target, weight, delta: float, hard_example_weight: float):
    """Huber loss on the standardised target; optional extra weight on examples with large errors."""
    per_sample = F.huber_loss(pred, target, reduction="none", delta=delta)
    if hard_example_weight > 0:
        err = (pred - target).abs().detach()
        weight = weight * (1.0 + hard_example_weight * err / (err.mean() + 1e-6))
    return (per_sample * weight).sum() / weight.sum()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class ProgressLines:
    """With CLOUDML_PROGRESS=1 (the notebook's training subprocess), one `@progress {json}` line on stdout
    after an optimizer step, at most twice a second: the notebook's bar follows every step, not only the
    logged ones, while tqdm's own bar is off (TQDM_DISABLE=1)."""
    PREFIX, EVERY_S = "@progress ", 0.5

    def __init__(self, enabled: bool):
        self.enabled, self.last = enabled, 0.0

    def __call__(self, state: dict, total: int, epochs: int, batches: int) -> None:
        if not self.enabled or time.monotonic() - self.last < self.EVERY_S:
            return
        self.last = time.monotonic()
        try:
            print(self.PREFIX + json.dumps({"step": state["step"], "total": total, "epoch": state["epoch"] + 1,
                                            "epochs": epochs, "batch": state["batch"], "batches": batches}), flush=True)
        except OSError:                  # the notebook is gone (a closed pipe): training goes on without it
            self.enabled = False


def _ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path, resume: str = "auto", init_from: Path | None = None,
                 dist: Dist = SINGLE):
        """`init_from`: a best.pt whose weights a new run starts from (fine-tuning); ignored on resume.
        `dist`: this process's place in a torchrun job; only rank 0 writes files."""
        self.cfg, self.run_dir, self.resume, self.init_from = cfg, Path(run_dir), resume, init_from
        self.dist = dist
        # Everything about the loop's progress lives in this one dict (saved in every checkpoint).
        self.state = {"epoch": 0, "step": 0, "batch": 0, "best_val_loss": math.inf, "best_epoch": 0,
                      "bad_epochs": 0, "history": [], "finished": False, "stopped_early": False,
                      "micro_batch_size": None, "eval_batch_size": None, "oom_recoveries": 0,
                      "nonfinite_in_a_row": 0, "nonfinite_total": 0,
                      "run_id": uuid.uuid4().hex[:12]}          # which run a checkpoint belongs to (--resume PATH)
        self.lock = None
        self.writer = None
        self._stop_signal = None
        self.checkpoint_stalls: list[float] = []     # seconds the loop waited per save (benchmarks read it)
        self._caches_checked, self._compile_said = False, False
        self.progress = ProgressLines(dist.is_main and os.environ.get("CLOUDML_PROGRESS") == "1")

    # ---------------------------------------------------------------------------------- set-up
    def setup(self) -> "Trainer":
        cfg, t = self.cfg, self.cfg.train
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise CloudMLError(f"--run-dir {self.run_dir} is a file, not a folder; choose a folder for the run")
        check_folder_kind(self.run_dir, "train")
        fault_point("setup")
        # The data first: a data or config error must not leave a run folder behind. data.flights is
        # resolved before configs are compared. Rank 0 builds any missing cache; the others then read it.
        self.train_set, self.val_set = self.dist.main_first(lambda: prepare_data(cfg, prepare_flights(cfg.data)))
        self._check_batch_size()
        self.fingerprint = self.data_fingerprint()          # fixed for the run; stored in every checkpoint
        self.provenance = run_provenance(self.train_set.caches + self.val_set.caches, cfg.data)   # the same
        try:
            found = self._claim_run_dir()
            seed_everything(t.seed)
            self.quick_val = quick_subset(len(self.val_set), t.quick_val_fraction)
            self._build_model_and_optimizer()
            if self.dist.is_main:
                self.writer = CheckpointWriter(self.run_dir, cfg.checkpoint.keep_last)
            if found is not None:
                self._restore(found)
            else:
                truncate_metrics(self.run_dir, 0)
                if self.init_from is not None:
                    self.model.load_state_dict(load_checkpoint(self.init_from)["model"])   # in place
                    log.info("Starting from the weights of %s", self.init_from)
            self._write_run_info(found)
        except BaseException:
            self.close()
            raise
        self._last_save = time.monotonic()
        return self

    def _claim_run_dir(self) -> Found | None:
        """Rank 0 locks the run folder, cleans leftovers and picks the checkpoint to resume from; every
        other rank then loads that same committed checkpoint (its checksums verified again)."""
        def claim():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.lock = RunLock(self.run_dir)
            self.lock.acquire()
            attach_run_log(self.run_dir)
            clean_leftovers(self.run_dir)
            found = find_resume_point(self.run_dir, self.resume)
            if found is not None:
                check_resume_config(self.cfg, found.state["config"])
                check_data_fingerprint(found.state.get("data_fingerprint"), self.fingerprint)
            save_config(self.cfg, self.run_dir / "config.yaml")
            log.info("Flights:\n%s", self.train_set.flight_table)
            return found

        found = self.dist.main_first(claim if self.dist.is_main else lambda: None)   # rank 0's error stops all
        if not self.dist.active:
            return found
        folder = self.dist.from_main(None if found is None else str(found.folder))
        if self.dist.is_main or folder is None:
            return found
        reason, state, meta = check_folder(Path(folder))
        if reason is not None:
            raise CloudMLError(f"rank {self.dist.rank} cannot read the checkpoint rank 0 resumes from, {folder}: "
                               f"{reason}. Every process must see the same run folder (a shared disk).")
        return Found(Path(folder), state, [], meta)

    def _check_batch_size(self) -> None:
        t, n = self.cfg.train, len(self.train_set)
        if t.batch_size != "auto" and t.batch_size < self.dist.world:
            raise ConfigError(f"train.batch_size {t.batch_size} is the global batch, shared by the {self.dist.world} "
                              f"processes: it must be at least {self.dist.world}")
        if t.batch_size != "auto" and t.batch_size * t.grad_accum_steps > n:
            fixes = ([f"train.batch_size <= {n // t.grad_accum_steps}"] if n // t.grad_accum_steps >= 1 else []) + \
                ([f"train.grad_accum_steps <= {n // t.batch_size} (with train.batch_size {t.batch_size})"]
                 if n // t.batch_size >= 1 else [])
            fix = " or ".join(fixes) or f"train.batch_size <= {n} with train.grad_accum_steps: 1"
            raise ConfigError(f"train.batch_size {t.batch_size} x train.grad_accum_steps {t.grad_accum_steps} = "
                              f"{t.batch_size * t.grad_accum_steps} samples per optimizer step, larger than the training "
                              f"set ({n} samples): every epoch would be a single step. Choose {fix}.")

    def data_fingerprint(self) -> dict:
        """What the run trains and validates on, by content: per flight its sample count and a hash of
        its labelled frames, labels and angles. A resumed run must see the same (file times may differ)."""
        out = {}
        for c in self.train_set.caches + self.val_set.caches:
            h = hashlib.sha256()
            for a in (c.frame_index, c.cbh_km, c.sza_deg, c.saa_deg, c.heading_deg, c.windows):
                h.update(np.ascontiguousarray(a).tobytes())
            h.update(str(c.meta.get("frames_sha256", c.meta.get("bytes"))).encode())
            out[c.name] = {"samples": len(c), "sha256": h.hexdigest()[:16]}
        return out

    def _build_model_and_optimizer(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        self.model = build_model(cfg)
        self.model.set_grad_checkpointing(cfg.model.gradient_checkpointing)
        self.device = choose_device(t.device)
        if self.device.type == "cuda" and self.dist.active:
            self.device = torch.device("cuda", self.dist.local_rank)
        self.model.to(self.device)
        if self.dist.active:
            self.model = apply_global_batchnorm(self.model, self.device)
        self.precision = choose_precision(self.device)
        self.autocast = (partial(torch.autocast, self.device.type, dtype=self.precision.dtype)
                         if self.precision.dtype else nullcontext)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.use_grad_scaler)
        self.ddp = (apply_ddp(self.model, self.dist, self.device, unused_parameters=cfg.model.scalars_only)
                    if self.dist.active else self.model)
        self.forward = self.ddp                # what a training step calls (tests may wrap it)
        if t.batch_size == "auto":             # per process; the global batch is what every process can hold
            per_process = measure_batch_size(self.model, self.autocast, self.device, cfg.data.temporal_frames,
                                             self.train_set.caches[0].frame_shape)
            t.batch_size = min(self.dist.gather(per_process)) * self.dist.world
        # after the batch-size probe, whose copy of the model must not share the compiled encoder
        self.compile = apply_compile(self.model, t.torch_compile, t.torch_compile_mode, self.device)
        self.state["micro_batch_size"] = t.batch_size         # a resumed run restores its own below
        self.state["eval_batch_size"] = 2 * t.batch_size
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
        self.sampler = EpochBatchSampler(len(self.train_set), t.batch_size, t.seed, rank=self.dist.rank,
                                         world=self.dist.world)
        if self.dist.active:
            torch.manual_seed(t.seed + self.dist.rank)      # each process its own dropout masks
        self.steps_per_epoch = math.ceil(self.sampler.batches_per_epoch() / t.grad_accum_steps)
        self.total_steps = self.steps_per_epoch * t.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, warmup_steps=t.warmup_steps, total_steps=self.total_steps,
                                    min_ratio=t.min_lr_ratio))
        # The loader draws its worker seed from its own generator, not the global RNG, so that
        # starting a fresh iterator on resume does not shift the dropout masks that follow.
        self.loader_rng = torch.Generator().manual_seed(t.seed)
        self.num_workers = default_num_workers() if cfg.data.num_workers == "auto" else cfg.data.num_workers
        self.loader = DataLoader(self.train_set, batch_sampler=self.sampler, num_workers=self.num_workers,
                                 pin_memory=self.device.type == "cuda", generator=self.loader_rng)
        zero = torch.zeros((), device=self.device)
        self.acc = {"epoch_loss": zero.clone(), "epoch_batches": zero.clone(), "window_loss": zero.clone(),
                    "window_batches": zero.clone(), "window_samples": 0}
        log.info("model: %s parameters, channels %s, gradient checkpointing %s; device %s, precision %s; "
                 "batch %d%s, %d optimizer steps per epoch, %d loader workers", f"{count_parameters(self.model):,}",
                 cfg.channels, "on" if cfg.model.gradient_checkpointing else "off", describe_device(self.device),
                 self.precision.name, t.batch_size,
                 f" over {self.dist.world} processes (BatchNorm over the whole batch)" if self.dist.active else "",
                 self.steps_per_epoch, self.num_workers)

    # ------------------------------------------------------------------------- resume logic
    def _restore(self, found: Found) -> None:
        s = found.state
        self.model.load_state_dict(s["model"])             # copies into the existing parameters, in place
        self.optimizer.load_state_dict(s["optimizer"])
        self.scheduler.load_state_dict(s["scheduler"])
        self.scaler.load_state_dict(s["scaler"])
        loop = dict(s["loop"])
        # The saved sums are over all processes: rank 0 carries them on, the others add from zero.
        self.acc = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) * self.dist.is_main
                    for k, v in loop.pop("acc").items()}
        self.state.update(loop)
        per_rank = s.get("rng_ranks") or [s["rng"]]
        if len(per_rank) != self.dist.world:
            log.warning("This run was saved by %d process(es) and resumes with %d: the data order and batches are "
                        "the same, the dropout random streams start anew (the result is not bit-identical to an "
                        "uninterrupted run).", len(per_rank), self.dist.world)
        restore_rng(per_rank[self.dist.rank % len(per_rank)], self.loader_rng)
        truncate_metrics(self.run_dir, s["metrics_bytes"])
        saved_epochs = s["config"]["train"]["epochs"]
        if self.state["finished"] and self.cfg.train.epochs > saved_epochs and not self.state["stopped_early"]:
            self.state["finished"] = False                  # more epochs asked for: carry on
        meta = read_meta(found.folder)
        st = self.state
        where = ("finished" if st["finished"] else
                 f"epoch {st['epoch'] + 1}, batch {st['batch']}/{self.sampler.batches_per_epoch()}")
        rejected = f"; rejected {len(found.rejected)} checkpoint(s)" if found.rejected else ""
        log.info("Resumed from step %d (%s), saved %s%s", st["step"], where, _ago(time.time() - meta["saved_at"]),
                 rejected)

    def _write_run_info(self, found: Found | None = None) -> None:
        """run.json: the plan of this (re)start, for progress bars and monitors, and what torch.compile did
        (rewritten at each start, after the first step and at each epoch's end)."""
        if found is not None or not hasattr(self, "_run_info"):
            self._run_info = {
                "processes": self.dist.world, "total_steps": self.total_steps, "steps_per_epoch": self.steps_per_epoch,
                "epochs": self.cfg.train.epochs, "batch_size": self.cfg.train.batch_size,
                "device": describe_device(self.device), "started_at": time.time(), "start_step": self.state["step"],
                "resumed_from": str(found.folder) if found is not None else None}
        if self.dist.is_main:
            info = dict(self._run_info, compile=self.compile.update().to_dict())
            write_text(self.run_dir / "run.json", json.dumps(json_safe(info), indent=1))
            if found is not None or not (self.run_dir / "provenance.json").is_file():
                write_run_provenance(self.run_dir, json_safe(self.provenance))

    def _report_compile(self) -> None:
        """After this start's first step (when compiling happened): say what was compiled, once."""
        if self._compile_said or not (self.compile.report.requested or self.compile.report.fallback):
            return
        self._compile_said = True
        report = self.compile.update()
        (log.info if report.active else log.warning)("torch.compile: %s", report.describe())
        self._write_run_info()

    # ----------------------------------------------------------------------------- snapshot
    def snapshot(self) -> dict:
        """Everything a bit-exact resume needs, as CPU tensors and plain types."""
        # to_cpu copies every container too: the writer thread serialises this while the loop goes on.
        acc = self.acc
        if self.dist.active:                              # the sums over all processes (see _restore)
            acc = {k: self.dist.all_sum(v) if isinstance(v, torch.Tensor) else v for k, v in acc.items()}
            acc["window_samples"] = int(self.dist.all_sum(torch.tensor(acc["window_samples"], device=self.device)))
        rng_ranks = self.dist.gather(capture_rng(self.loader_rng))
        if not self.dist.is_main:
            return {}
        loop = to_cpu(dict(self.state, acc=acc))
        return {"format": FORMAT_VERSION, "model": cpu_state_dict(self.model),
                "optimizer": to_cpu(self.optimizer.state_dict()), "scheduler": to_cpu(self.scheduler.state_dict()),
                "scaler": to_cpu(self.scaler.state_dict()), "loop": loop,
                "sampler": {"seed": self.sampler.seed, "epoch": self.state["epoch"], "position": self.state["batch"],
                            "samples": self.sampler.samples_before(self.state["batch"])},
                "rng": rng_ranks[0], "rng_ranks": rng_ranks if self.dist.active else None,
                "processes": self.dist.world, "config": self.cfg.to_dict(),
                "scalers": self.val_set.scalers.to_dict(), "data_fingerprint": self.fingerprint,
                "provenance": self.provenance, "metrics_bytes": (self.run_dir / "metrics.jsonl").stat().st_size}

    def save_checkpoint(self, reason: str, wait: bool = False) -> float:
        """Snapshot now (a step boundary) and commit in the background; returns the caller's stall.
        After MAX_FAILED_SAVES failed saves in a row training stops: work that cannot be saved is at risk."""
        t0 = time.perf_counter()
        state = self.snapshot()                           # every rank: the snapshot gathers from all of them
        if not self.dist.is_main:
            self._last_save = time.monotonic()
            return 0.0
        if self.writer.failures_in_a_row >= MAX_FAILED_SAVES:
            self.writer.wait()
            raise CloudMLError(
                f"{self.writer.failures_in_a_row} checkpoints in a row could not be written to "
                f"{self.run_dir / 'checkpoints'} ({self.writer.last_error}). Training stops so that no more work goes "
                "unsaved. Free space there or make it writable, then run the same command again to resume from "
                "the last checkpoint that was written.")
        st = self.state
        best = next((h for h in st["history"] if h["epoch"] == st["best_epoch"]), None)
        meta = {"step": st["step"], "epoch": st["epoch"], "batch": st["batch"],
                "samples_in_epoch": self.sampler.samples_before(st["batch"]), "epochs": self.cfg.train.epochs,
                "batches_per_epoch": self.sampler.batches_per_epoch(), "total_steps": self.total_steps,
                "finished": st["finished"], "stopped_early": st["stopped_early"], "run_id": st["run_id"],
                "reason": reason,
                "best_metric": st["best_val_loss"] if math.isfinite(st["best_val_loss"]) else None,
                "best_r2": best["r2"] if best else None, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        self.writer.submit(state, meta, wait=wait)
        stall = time.perf_counter() - t0
        self.checkpoint_stalls.append(stall)
        self._last_save = time.monotonic()
        return stall

    # ------------------------------------------------------------------------------- one step
    def train_step(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one batch, recovering from GPU out-of-memory and compile failures.

        Out of memory: the batch is redone in micro-batches of half the size (the effective batch
        and the learning rate stay; BatchNorm then normalises each micro-batch on its own), up to
        micro-batches of one sample. A torch.compile failure: the batch is redone in eager mode.
        Either way the attempt's partial effects (gradients, BatchNorm statistics, RNG) are undone
        first, so nothing is counted twice.
        """
        keep_grads = bool(self.state["batch"] % self.cfg.train.grad_accum_steps)
        for _ in range(MAX_ATTEMPTS):
            before = capture_undo(self.model, self.device, keep_grads)
            compiled = self.compile.report.active or self.forward is not self.ddp
            loss, failure = run_attempt(lambda: self._forward_backward(batch), compiled)
            if failure is None:
                return loss
            if self.dist.active:            # the other processes are inside this step's collectives
                raise CloudMLError(
                    f"process {self.dist.rank} of {self.dist.world} failed in training step {self.state['step']} "
                    f"({failure}); with several processes this is not retried. "
                    + ("Lower train.batch_size (the global batch), " if failure == "oom" else
                       "Set train.torch_compile: false, ") + "then run the same command to resume.")
            undo(before, self.model, self.optimizer, self.device)
            if failure == "oom":
                halve_micro_batch(self.state, len(batch["target"]), self.cfg.train.batch_size)
            else:
                self.forward = eager_after_compile_failure(self.ddp, self.compile, failure)
                self._write_run_info()
        raise CloudMLError("a training step kept failing after every recovery was tried; see the log above")

    def _forward_backward(self, batch: dict) -> torch.Tensor:
        """Loss of the whole batch, gradients accumulated micro-batch by micro-batch."""
        t = self.cfg.train
        n, mb = len(batch["target"]), self.state["micro_batch_size"]
        # The weighted mean is over the global batch: each process's gradients are its share of it,
        # scaled by the process count because DDP averages them.
        weight_total = batch["weight"].sum()
        if self.dist.active:
            weight_total = self.dist.all_sum(weight_total.to(self.device))
        last_of_step = (self.state["batch"] + 1) % t.grad_accum_steps == 0 or \
            self.state["batch"] + 1 == self.sampler.batches_per_epoch()
        total = torch.zeros((), device=self.device)
        for lo in range(0, n, mb):
            part = slice(lo, min(n, lo + mb))
            frames = batch["frames"][part].to(self.device, non_blocking=True)          # (b, T, H, W)
            scalars = batch["scalars"][part].to(self.device, non_blocking=True)        # (b, 2)
            target = batch["target"][part].to(self.device, non_blocking=True)          # (b,)
            weight = batch["weight"][part].to(self.device, non_blocking=True)          # (b,)
            # Gradients are averaged across processes once per optimizer step, in its last backward.
            with self._no_sync(not (last_of_step and lo + mb >= n)):
                with self.autocast():
                    pred = self.forward(frames, scalars)
                # This part's share of the batch's weighted mean (exactly the mean when not split).
                share = (weight.sum() / weight_total).to(self.device)
                loss = weighted_huber(pred.float(), target, weight, t.huber_delta, t.hard_example_weight) * share
                self.scaler.scale(loss * self.dist.world / t.grad_accum_steps).backward()
            total += loss.detach()
        return total

    def _no_sync(self, skip: bool):
        return self.ddp.no_sync() if skip and self.dist.active else nullcontext()

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        if self.cfg.train.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state["step"] += 1

    def skip_step(self) -> None:
        """A step whose loss was NaN/inf: its gradients are dropped and the weights stay as they were."""
        st = self.state
        self.optimizer.zero_grad(set_to_none=True)
        st["nonfinite_in_a_row"] += 1
        st["nonfinite_total"] += 1
        limit = self.cfg.train.max_nonfinite_steps
        log.warning("Non-finite loss at step %d (epoch %d, batch %d): step skipped, weights unchanged (%d in a row, "
                    "%d in all).", st["step"], st["epoch"] + 1, st["batch"], st["nonfinite_in_a_row"],
                    st["nonfinite_total"])
        self._check_caches_once()
        if st["nonfinite_in_a_row"] >= limit:
            raise CloudMLError(
                f"training stopped: {limit} optimizer steps in a row had a NaN or infinite loss "
                f"(train.max_nonfinite_steps). The preprocessing cache was checked against its checksums and is "
                f"intact, so the data did not change; the weights were never updated with those steps, and best.pt "
                f"and the checkpoints hold finite models. Lower train.learning_rate (now "
                f"{self.cfg.train.learning_rate}), then run the same command to resume from the last checkpoint.")

    def _check_caches_once(self) -> None:
        """A NaN loss can come from bit rot in the cache rather than the optimisation: the first time one
        appears, every cache is checked against the checksum recorded when it was built (same files on
        every process, so all take the same decision)."""
        if self._caches_checked:
            return
        self._caches_checked = True
        t0 = time.time()
        problems = [p for p in map(verify_cache, self.train_set.caches + self.val_set.caches) if p]
        if problems:
            raise DataError("NaN/inf losses: " + "; ".join(problems) + ". Delete the named cache folder(s): they are "
                            "rebuilt from the IR files at the next start. Then run the same command again: training "
                            "resumes from the last checkpoint, whose weights are finite.")
        log.info("The preprocessing cache matches its checksums (checked in %.1f s): the data is intact",
                 time.time() - t0)

    # ------------------------------------------------------------------------------ the loop
    def train_epoch(self, epoch: int) -> float:
        t, st, acc = self.cfg.train, self.state, self.acc
        self.model.train()
        self.sampler.set_epoch(epoch, start_batch=st["batch"])
        self.train_set.set_epoch(epoch)
        n_total = self.sampler.batches_per_epoch()
        # Only the other processes are switched off here: on rank 0 tqdm's own TQDM_DISABLE decides (the
        # notebook's subprocess sets it; an explicit disable= would override it and flood the cell).
        bar = tqdm(self.loader, total=n_total, initial=st["batch"], desc=f"epoch {epoch + 1}/{t.epochs}",
                   unit="batch", leave=False, **({} if self.dist.is_main else {"disable": True}))
        self._window_t0 = time.time()
        finite = torch.ones((), dtype=torch.bool, device=self.device)
        for batch in bar:
            loss = self.train_step(batch)
            ok = torch.isfinite(loss)
            finite &= ok
            # Device-side sums: no sync per batch; a NaN batch does not poison the epoch's mean.
            acc["epoch_loss"] += torch.where(ok, loss, 0.0)
            acc["window_loss"] += torch.where(ok, loss, 0.0)
            acc["epoch_batches"] += ok
            acc["window_batches"] += ok
            acc["window_samples"] += len(batch["target"])
            st["batch"] += 1
            if st["batch"] % t.grad_accum_steps == 0 or st["batch"] == n_total:
                # One sync per optimizer step, as a GradScaler has; all processes skip a step together.
                if not self.dist.any_true(not bool(finite), device=self.device)[0]:
                    st["nonfinite_in_a_row"] = 0
                    self.optimizer_step()
                    if st["step"] % t.log_every_steps == 0:
                        self._log_step(epoch, bar)
                else:
                    self.skip_step()
                    finite.fill_(True)
                self._after_step()
        bar.close()
        return self._mean_loss(acc["epoch_loss"], acc["epoch_batches"])

    def _mean_loss(self, loss_sum: torch.Tensor, batches: torch.Tensor) -> float:
        """Mean batch loss: each process holds its parts of the global batches' losses."""
        loss_sum, batches = self.dist.all_sum(torch.stack([loss_sum, batches.float()])).tolist()
        return loss_sum / max(1.0, batches / self.dist.world)

    def _after_step(self) -> None:
        """Checkpoint cadence, test fault point, and a stop asked for by a signal."""
        c, st = self.cfg.checkpoint, self.state
        by_steps = st["step"] % c.every_steps == 0
        # Clocks and signals differ between processes: they agree on both (one small collective).
        by_time, stop = self.dist.any_true(time.monotonic() - self._last_save >= 60 * c.every_minutes,
                                           self._stop_signal is not None, device=self.device)
        if stop and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM                  # another process was asked to stop
        # An epoch's last step is saved right after its validation instead (same step number).
        if (by_steps or by_time) and st["batch"] < self.sampler.batches_per_epoch():
            self.save_checkpoint("every_steps" if by_steps else "every_minutes")
        self.progress(st, self.total_steps, self.cfg.train.epochs, self.sampler.batches_per_epoch())
        self._report_compile()
        fault_point("step")
        if stop:
            self._stop_now()

    def _stop_now(self) -> None:
        name = signal.Signals(self._stop_signal).name
        self.save_checkpoint(name, wait=True)
        self.dist.barrier()                                     # no process leaves before the save is committed
        log.warning("Stopped by %s at step %d; checkpoint saved in %s. Run the same command again to resume.",
                    name, self.state["step"], self.run_dir / "checkpoints")
        raise KeyboardInterrupt(f"stopped by {name}; progress saved")

    def _log_step(self, epoch: int, bar) -> None:
        """A metrics.jsonl step record and the progress bar's postfix (one device sync per log interval)."""
        acc = self.acc
        loss_sum, batches, samples = self.dist.all_sum(torch.stack([
            acc["window_loss"], acc["window_batches"].float(),
            torch.tensor(float(acc["window_samples"]), device=self.device)])).tolist()
        rate = samples / max(1e-9, time.time() - self._window_t0)
        record = {"kind": "step", "epoch": epoch + 1, "step": self.state["step"],
                  "loss": loss_sum / max(1.0, batches / self.dist.world),
                  "lr": self.optimizer.param_groups[0]["lr"], "samples_per_s": rate, "time": time.time()}
        self._append_metrics(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", samples_s=f"{rate:.1f}")
        acc["window_loss"] = torch.zeros((), device=self.device)
        acc["window_batches"] = torch.zeros((), device=self.device)
        acc["window_samples"] = 0
        self._window_t0 = time.time()

    def validate(self, indices: np.ndarray | None = None) -> tuple[float, dict, np.ndarray]:
        """Validation loss (standardised Huber), metrics in km and predictions in km.

        Out of memory halves the evaluation batch (kept for the rest of the run); a compile failure
        switches to eager mode. Predictions do not depend on the evaluation batch size.
        """
        indices = np.arange(len(self.val_set)) if indices is None else indices
        mine = indices[self.dist.shard(len(indices))]            # each process scores its part; all get the whole
        for _ in range(MAX_ATTEMPTS):
            # With several processes, the plain module: DDP's forward (compiled or not) would wait for
            # matching calls in the others, whose parts may hold one batch more or less.
            forward = self.model if self.dist.active else self.forward
            result, failure = run_attempt(lambda: predict(
                self.model, self.val_set, self.device, self.state["eval_batch_size"], self.autocast, mine,
                self.num_workers, forward=forward), self.compile.report.active or forward is not self.model)
            if failure is None:
                pred, target = (np.concatenate(p) for p in zip(*self.dist.gather(result)))
                break
            release_memory(self.device)
            if failure == "oom":
                halve_eval_batch(self.state)
            else:
                self.forward = eager_after_compile_failure(self.ddp, self.compile, failure)
                self._write_run_info()
        else:
            raise CloudMLError("validation kept failing after every recovery was tried; see the log above")
        loss = float(F.huber_loss(torch.from_numpy(pred), torch.from_numpy(target), delta=self.cfg.train.huber_delta))
        s = self.val_set.scalers
        pred_km, true_km = pred * s.cbh_std + s.cbh_mean, target * s.cbh_std + s.cbh_mean
        return loss, regression_metrics(true_km, pred_km), pred_km

    def fit(self) -> dict:
        t, st = self.cfg.train, self.state
        try:
            if st["finished"]:
                log.info("This run already finished (epoch %d/%d); nothing to train. Raise train.epochs to train "
                         "longer, or use another --run-dir for a new run.", st["epoch"], t.epochs)
                return self._stored_report()
            with self._signals_trapped():
                while st["epoch"] < t.epochs:
                    if self._run_epoch():
                        break
                return self.finish()
        finally:
            self.close()

    def _run_epoch(self) -> bool:
        """Train the rest of the current epoch, validate, save; returns True when training should stop."""
        t, st = self.cfg.train, self.state
        epoch, t0 = st["epoch"], time.time()
        train_loss = self.train_epoch(epoch)
        val_loss, m, _ = self.validate(self.quick_val)
        memory = memory_readings(self.device)
        record = {"epoch": epoch + 1, "step": st["step"], "train_loss": train_loss, "val_loss": val_loss,
                  "r2": m["r2"], "mae_km": m["mae_km"], "rmse_km": m["rmse_km"],
                  "lr": self.optimizer.param_groups[0]["lr"], "time_s": time.time() - t0}
        st["history"].append(record)
        self._append_metrics({"kind": "epoch", **record, "memory": memory})
        log.info("Epoch %d/%d | train_loss %.3f | val_loss %.3f | R2 %.2f | MAE %.3f km | lr %.1e | %.1f s | %s",
                 epoch + 1, t.epochs, train_loss, val_loss, m["r2"], m["mae_km"], record["lr"], record["time_s"],
                 format_memory(memory))
        stop = self._update_best(val_loss, epoch + 1)
        st["epoch"], st["batch"], st["stopped_early"] = epoch + 1, 0, stop
        self.acc["epoch_loss"] = torch.zeros((), device=self.device)
        self.acc["epoch_batches"] = torch.zeros((), device=self.device)
        self._write_run_info()                              # recompiles for validation show here
        if stop or st["epoch"] >= t.epochs:
            return True
        self.save_checkpoint("epoch_end")
        if self.dist.any_true(self._stop_signal is not None, device=self.device)[0]:
            self._stop_signal = self._stop_signal or signal.SIGTERM
            self._stop_now()
        return False

    def _update_best(self, val_loss: float, epoch: int) -> bool:
        """Save a better model; returns True when early stopping says stop."""
        s = self.state
        finite_model = all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        if not finite_model:
            log.warning("The model has NaN/inf weights after epoch %d: it is not saved as best", epoch)
        if finite_model and math.isfinite(val_loss) and val_loss < s["best_val_loss"]:
            s["best_val_loss"], s["best_epoch"], s["bad_epochs"] = val_loss, epoch, 0
            if self.dist.is_main:
                self.save_best()
            log.info("New best model saved (val_loss %.4f, epoch %d) -> %s", val_loss, epoch, self.run_dir / "best.pt")
            return False
        s["bad_epochs"] += 1
        patience = self.cfg.train.early_stopping_patience
        if patience and s["bad_epochs"] >= patience:
            log.info("Early stopping: no better validation loss for %d epochs (best %.4f at epoch %d)",
                     s["bad_epochs"], s["best_val_loss"], s["best_epoch"])
            return True
        return False

    def save_best(self) -> None:
        save_atomic({"format": FORMAT_VERSION, "model": cpu_state_dict(self.model), "config": self.cfg.to_dict(),
                     "scalers": self.val_set.scalers.to_dict(), "epoch": self.state["best_epoch"],
                     "step": self.state["step"], "val_loss": self.state["best_val_loss"],
                     "train_mean_km": float(self.train_set.targets_km().mean()), "provenance": self.provenance},
                    self.run_dir / "best.pt")

    def _evaluate_best(self) -> dict:
        """Full validation with the best weights (the newest if best.pt cannot be used, which is then
        rewritten); rank 0 writes evaluation.json, predictions.csv and the scatter plot."""
        best = self.run_dir / "best.pt"
        if best.exists():
            try:
                self.model.load_state_dict(load_checkpoint(best)["model"])
            except (CloudMLError, RuntimeError, KeyError, TypeError) as e:
                log.warning("%s cannot be used (%s). The final evaluation uses the newest weights (epoch %d) instead, "
                            "and best.pt is rewritten with them.", best, str(e).splitlines()[0], self.state["epoch"])
                self.state["best_epoch"] = self.state["epoch"]
                if self.dist.is_main:
                    self.save_best()
        _, _, pred_km = self.validate()
        report = build_report(self.val_set, pred_km, float(self.train_set.targets_km().mean()), self.state["best_epoch"])
        if self.dist.is_main:
            write_evaluation(self.run_dir, self.val_set, pred_km, report)
        return report

    def finish(self) -> dict:
        """Full validation with the best weights; predictions, report, plots; the final checkpoint."""
        if self.writer is not None:
            self.writer.wait()
        self.dist.barrier()                                 # rank 0's best.pt is written before anyone reads it
        report = self._evaluate_best()
        self.state["finished"] = True
        if self.dist.is_main:
            self._append_metrics({"kind": "final", "epoch": self.state["epoch"], "step": self.state["step"],
                                  **report["overall"], "baseline": report["baseline"],
                                  "per_flight": report["per_flight"]})
            if self.state["history"]:
                plots.save_figure(plots.curves_figure(self.state["history"]), self.run_dir / "plots" / "curves.png")
            write_report(self.run_dir)
        self.save_checkpoint("final", wait=True)            # every rank: the snapshot gathers from all of them
        self.dist.barrier()
        if not self.dist.is_main:
            return report
        if self.writer.failures_in_a_row:
            raise CloudMLError(f"the final checkpoint could not be written ({self.writer.last_error}); the results "
                               f"are in {self.run_dir}, but the run is not marked finished. Free space or fix the "
                               "folder's permissions, then run the same command again.")
        log.info("Full validation with the best model (epoch %d):\n%s", self.state["best_epoch"], format_report(report))
        log.info("Run directory: %s (best.pt, predictions.csv, evaluation.json, plots/)", self.run_dir)
        return report

    def _stored_report(self) -> dict:
        """A finished run's report; a missing or damaged evaluation.json is computed again from best.pt."""
        path = self.run_dir / "evaluation.json"
        try:
            report = json.loads(path.read_text())
            format_report(report)                           # the structure a report has
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            why = "missing" if isinstance(e, FileNotFoundError) else f"damaged ({type(e).__name__})"
            log.warning("%s is %s: scoring best.pt on the validation flights again", path, why)
            report = self._evaluate_best()
            if self.dist.is_main:
                write_report(self.run_dir)
        log.info("Its report:\n%s", format_report(report))
        return report

    def _append_metrics(self, record: dict) -> None:
        if not self.dist.is_main:
            return
        append_text(self.run_dir / "metrics.jsonl", json.dumps(json_safe(record)) + "\n")

    @contextmanager
    def _signals_trapped(self):
        """SIGTERM and a first Ctrl-C stop at the next step boundary with a checkpoint; a second Ctrl-C at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def ask_stop(signum, frame):
            if self._stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self._stop_signal = signum
            log.warning("%s received: stopping after the current step with a checkpoint (Ctrl-C again to stop "
                        "at once)", signal.Signals(signum).name)

        previous = {s: signal.signal(s, ask_stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def close(self) -> None:
        """Let an in-flight checkpoint finish, then release the run directory."""
        if self.writer is not None:
            self.writer.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def train(cfg: Config, run_dir: str | Path, resume: str = "auto", dist: Dist | None = None) -> dict:
    """One run; with train.pretrain_flight, the two-phase protocol (each phase resumable).
    `dist`: by default the torchrun job this process belongs to (or the single process)."""
    dist = init_distributed(cfg.train.device) if dist is None else dist
    try:
        if not cfg.train.pretrain_flight:
            return Trainer(cfg, run_dir, resume, dist=dist).setup().fit()
        return train_two_phase(cfg, Path(run_dir), resume, dist)
    except Exception as e:
        message = explain_peer_failure(e, dist)
        if message is None:
            raise
        raise CloudMLError(message) from None
    finally:
        dist.close()


def train_two_phase(cfg: Config, run_dir: Path, resume: str, dist: Dist = SINGLE) -> dict:
    """Phase 1 trains on train.pretrain_flight alone (RUN_DIR/pretrain, train.pretrain_epochs); phase 2
    fine-tunes from its best weights on all training flights, the pre-training flight weighted by
    data.overweight_factor (RUN_DIR). Each phase fits its own scalers on its own training flights.
    An interrupted phase resumes; a finished phase 1 is not trained again."""
    prepare_flights(cfg.data)
    names = [f.name for f in cfg.data.flights]
    problems = check_pretrain_flight(cfg, names)
    if problems:
        raise ConfigError("; ".join(problems))
    keep = {cfg.train.pretrain_flight, *cfg.data.validation_flights}
    phase1 = config_from_dict(cfg.to_dict())
    phase1.data.flights = [f for f in phase1.data.flights if f.name in keep]
    phase1.data.overweight_flight, phase1.train.pretrain_flight = "", ""
    phase1.train.epochs = cfg.train.pretrain_epochs
    log.info("Phase 1 of 2: pre-training on %s for %d epochs", cfg.train.pretrain_flight, phase1.train.epochs)
    Trainer(phase1, run_dir / "pretrain", resume, dist=dist).setup().fit()
    phase2 = config_from_dict(cfg.to_dict())
    phase2.data.overweight_flight = cfg.train.pretrain_flight
    log.info("Phase 2 of 2: fine-tuning on %s (%s weighted x%g)", ", ".join(n for n in names
             if n not in cfg.data.validation_flights), cfg.train.pretrain_flight, cfg.data.overweight_factor)
    return Trainer(phase2, run_dir, resume, init_from=run_dir / "pretrain" / "best.pt", dist=dist).setup().fit()
