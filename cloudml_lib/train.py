"""The Trainer: set-up in a fixed order, train_step, validate, fit.

Set-up order matters: seeds before the model is built (initial weights), data before the model
(scalers), the model on its device before torch.compile and before the optimizer is created (the
optimizer must hold the parameters that will be trained, and they are never re-allocated after).
Precision is decided once: autocast and GradScaler are built here, so the loop has no AMP branches
(a disabled GradScaler passes values through unchanged).
"""
from __future__ import annotations

import json
import logging
import math
import random
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from cloudml_lib import plots
from cloudml_lib.checkpoint import FORMAT_VERSION, cpu_state_dict, save_atomic
from cloudml_lib.config import Config, save_config
from cloudml_lib.data.cache import load_caches
from cloudml_lib.data.dataset import CloudDataset, EpochBatchSampler, fit_scalers, quick_subset, split_flights
from cloudml_lib.data.synthetic import ensure_demo_flights
from cloudml_lib.errors import CloudMLError
from cloudml_lib.evaluate import (build_report, format_report, json_safe, predict, regression_metrics,
                                  write_predictions)
from cloudml_lib.hardware import choose_device, choose_precision, describe_device
from cloudml_lib.model import build_model, count_parameters

log = logging.getLogger(__name__)
PACKAGE_LOGGER = "cloudml_lib"


class _TqdmHandler(logging.StreamHandler):
    """Console lines that do not break a running progress bar."""

    def emit(self, record):
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


def attach_run_log(run_dir: Path | None = None, console=None) -> logging.Logger:
    """The package logger prints to the console and, with a run directory, to train.log.

    It does not propagate: Colab's root logger already has a handler, which would print twice.
    `console` is the stream for screen lines (default stdout).
    """
    logger = logging.getLogger(PACKAGE_LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    for h in [h for h in logger.handlers if getattr(h, "_cloudml", False)]:
        logger.removeHandler(h)
        h.close()
    screen = _TqdmHandler(console or sys.stdout)
    screen.setFormatter(logging.Formatter("%(message)s"))
    handlers = [screen]
    if run_dir is not None:
        file = logging.FileHandler(Path(run_dir) / "train.log")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        handlers.append(file)
    for h in handlers:
        h._cloudml = True
        logger.addHandler(h)
    return logger


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


def apply_compile(model, cfg: Config, device: torch.device):
    """torch.compile from outside the model; the plain module stays the one that is saved."""
    if not cfg.train.torch_compile:
        return model
    if device.type != "cuda":
        log.info("train.torch_compile is on, but compiling pays off only on CUDA; running eager on %s", device.type)
        return model
    log.info("compiling the model with torch.compile(mode=%r); the first steps are slow", cfg.train.torch_compile_mode)
    return torch.compile(model, mode=cfg.train.torch_compile_mode)


def prepare_data(cfg: Config) -> tuple[CloudDataset, CloudDataset]:
    """Caches of all flights, split by flight, scalers fitted on the training flights only."""
    ensure_demo_flights(cfg.data)
    caches = load_caches(cfg.data)
    train, val = split_flights(caches, cfg)
    empty = [c.name for c in train + val if len(c) == 0]
    if empty:
        raise CloudMLError(f"flights with no usable samples: {', '.join(empty)}; see the counts in the log, "
                           "and the data.cbh_* / match_tolerance_s filters")
    scalers = fit_scalers(train)
    weights = {cfg.data.overweight_flight: cfg.data.overweight_factor} if cfg.data.overweight_flight else {}
    log.info("training flights: %s (%d samples); validation flights: %s (%d samples)",
             ", ".join(c.name for c in train), sum(map(len, train)), ", ".join(c.name for c in val),
             sum(map(len, val)))
    return (CloudDataset(train, scalers, augment=cfg.data.augment, seed=cfg.train.seed, flight_weights=weights),
            CloudDataset(val, scalers))


class Trainer:
    def __init__(self, cfg: Config, run_dir: str | Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        # Everything about the loop's progress lives in this one dict.
        self.state = {"epoch": 0, "step": 0, "best_val_loss": math.inf, "best_epoch": 0, "bad_epochs": 0,
                      "history": []}

    # ---------------------------------------------------------------------------------- set-up
    def setup(self) -> "Trainer":
        cfg, t = self.cfg, self.cfg.train
        if (self.run_dir / "metrics.jsonl").exists() or (self.run_dir / "best.pt").exists():
            raise CloudMLError(f"{self.run_dir} already holds a run; choose another --run-dir or delete it")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        attach_run_log(self.run_dir)
        save_config(cfg, self.run_dir / "config.yaml")
        seed_everything(t.seed)
        self.train_set, self.val_set = prepare_data(cfg)
        self.quick_val = quick_subset(len(self.val_set), t.quick_val_fraction)
        self.model = build_model(cfg)
        self.model.set_grad_checkpointing(cfg.model.gradient_checkpointing)
        self.device = choose_device(t.device)
        self.model.to(self.device)
        self.precision = choose_precision(self.device)
        self.autocast = (partial(torch.autocast, self.device.type, dtype=self.precision.dtype)
                         if self.precision.dtype else nullcontext)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision.use_grad_scaler)
        self.forward = apply_compile(self.model, cfg, self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
        self.sampler = EpochBatchSampler(len(self.train_set), t.batch_size, t.seed)
        self.steps_per_epoch = math.ceil(self.sampler.batches_per_epoch() / t.grad_accum_steps)
        self.total_steps = self.steps_per_epoch * t.epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, partial(lr_factor, warmup_steps=t.warmup_steps, total_steps=self.total_steps,
                                    min_ratio=t.min_lr_ratio))
        self.loader = DataLoader(self.train_set, batch_sampler=self.sampler, num_workers=cfg.data.num_workers,
                                 pin_memory=self.device.type == "cuda")
        log.info("model: %s parameters, channels %s, gradient checkpointing %s; device %s, precision %s; "
                 "%d optimizer steps per epoch", f"{count_parameters(self.model):,}", cfg.channels,
                 "on" if cfg.model.gradient_checkpointing else "off", describe_device(self.device),
                 self.precision.name, self.steps_per_epoch)
        return self

    # ------------------------------------------------------------------------------- one step
    def train_step(self, batch: dict) -> torch.Tensor:
        """Forward and backward of one batch; returns its loss (detached, on the device)."""
        t = self.cfg.train
        frames = batch["frames"].to(self.device, non_blocking=True)            # (B, T, H, W)
        scalars = batch["scalars"].to(self.device, non_blocking=True)          # (B, 2)
        target = batch["target"].to(self.device, non_blocking=True)            # (B,)
        weight = batch["weight"].to(self.device, non_blocking=True)            # (B,)
        with self.autocast():
            pred = self.forward(frames, scalars)
        loss = weighted_huber(pred.float(), target, weight, t.huber_delta, t.hard_example_weight)
        self.scaler.scale(loss / t.grad_accum_steps).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.scaler.unscale_(self.optimizer)
        if self.cfg.train.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.grad_clip_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state["step"] += 1

    # ------------------------------------------------------------------------------ the loop
    def train_epoch(self, epoch: int) -> float:
        t, accum = self.cfg.train, self.cfg.train.grad_accum_steps
        self.model.train()
        self.sampler.set_epoch(epoch)
        self.train_set.set_epoch(epoch)
        n_batches = len(self.sampler)
        total, window, window_n, t_window = torch.zeros((), device=self.device), torch.zeros((), device=self.device), 0, time.time()
        bar = tqdm(self.loader, total=n_batches, desc=f"epoch {epoch + 1}/{t.epochs}", unit="batch", leave=False)
        for i, batch in enumerate(bar):
            loss = self.train_step(batch)
            total += loss
            window += loss
            window_n += len(batch["target"])
            if (i + 1) % accum == 0 or i + 1 == n_batches:
                self.optimizer_step()
                if self.state["step"] % t.log_every_steps == 0:
                    window, window_n, t_window = self._log_step(epoch, window, window_n, t_window, i, bar)
        bar.close()
        return float(total) / max(1, n_batches)

    def _log_step(self, epoch, window, window_n, t_window, i, bar):
        """A metrics.jsonl step record and the progress bar's postfix (one device sync per log interval)."""
        steps = self.cfg.train.log_every_steps * self.cfg.train.grad_accum_steps
        rate = window_n / max(1e-9, time.time() - t_window)
        record = {"kind": "step", "epoch": epoch + 1, "step": self.state["step"], "loss": float(window) / steps,
                  "lr": self.optimizer.param_groups[0]["lr"], "samples_per_s": rate}
        self._append_metrics(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", samples_s=f"{rate:.1f}")
        return torch.zeros((), device=self.device), 0, time.time()

    def validate(self, indices: np.ndarray | None = None) -> tuple[float, dict, np.ndarray]:
        """Validation loss (standardised Huber), metrics in km and predictions in km."""
        pred, target = predict(self.forward, self.val_set, self.device, 2 * self.cfg.train.batch_size,
                               self.autocast, indices, self.cfg.data.num_workers)
        loss = float(F.huber_loss(torch.from_numpy(pred), torch.from_numpy(target), delta=self.cfg.train.huber_delta))
        s = self.val_set.scalers
        pred_km, true_km = pred * s.cbh_std + s.cbh_mean, target * s.cbh_std + s.cbh_mean
        return loss, regression_metrics(true_km, pred_km), pred_km

    def fit(self) -> dict:
        t = self.cfg.train
        log.info("training for %d epochs on %s", t.epochs, self.device)
        while self.state["epoch"] < t.epochs:
            epoch, t0 = self.state["epoch"], time.time()
            train_loss = self.train_epoch(epoch)
            val_loss, m, _ = self.validate(self.quick_val)
            self.state["epoch"] = epoch + 1
            record = {"epoch": epoch + 1, "step": self.state["step"], "train_loss": train_loss, "val_loss": val_loss,
                      "r2": m["r2"], "mae_km": m["mae_km"], "rmse_km": m["rmse_km"],
                      "lr": self.optimizer.param_groups[0]["lr"], "time_s": time.time() - t0}
            self.state["history"].append(record)
            self._append_metrics({"kind": "epoch", **record})
            log.info("Epoch %d/%d | train_loss %.3f | val_loss %.3f | R2 %.2f | MAE %.3f km | lr %.1e | %.1f s",
                     epoch + 1, t.epochs, train_loss, val_loss, m["r2"], m["mae_km"], record["lr"], record["time_s"])
            if self._update_best(val_loss, epoch + 1):
                break
        return self.finish()

    def _update_best(self, val_loss: float, epoch: int) -> bool:
        """Save a better model; returns True when early stopping says stop."""
        s = self.state
        if math.isfinite(val_loss) and val_loss < s["best_val_loss"]:
            s["best_val_loss"], s["best_epoch"], s["bad_epochs"] = val_loss, epoch, 0
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
                     "train_mean_km": float(self.train_set.targets_km().mean())}, self.run_dir / "best.pt")

    def finish(self) -> dict:
        """Full validation with the best weights; predictions, report and plots in the run directory."""
        best = self.run_dir / "best.pt"
        if best.exists():
            state = torch.load(best, map_location="cpu", weights_only=True)["model"]
            self.model.load_state_dict(state)          # copies into the existing parameters, in place
        _, _, pred_km = self.validate()
        report = build_report(self.val_set, pred_km, float(self.train_set.targets_km().mean()))
        report["best_epoch"] = self.state["best_epoch"]
        write_predictions(self.run_dir / "predictions.csv", self.val_set, pred_km)
        (self.run_dir / "evaluation.json").write_text(json.dumps(json_safe(report), indent=1))
        self._append_metrics({"kind": "final", "epoch": self.state["epoch"], "step": self.state["step"],
                              **{k: v for k, v in report["overall"].items()},
                              "baseline": report["baseline"], "per_flight": report["per_flight"]})
        if self.state["history"]:
            plots.save_figure(plots.curves_figure(self.state["history"]), self.run_dir / "plots" / "curves.png")
        flights = np.array([c.name for c in self.val_set.caches])[self.val_set.flight_of]
        plots.save_figure(plots.scatter_figure(self.val_set.targets_km(), pred_km, flights,
                                               f"Held-out flights, R2 {report['overall']['r2']:.2f}"),
                          self.run_dir / "plots" / "scatter.png")
        log.info("Full validation with the best model (epoch %d):\n%s", self.state["best_epoch"], format_report(report))
        log.info("Run directory: %s (best.pt, predictions.csv, evaluation.json, plots/)", self.run_dir)
        return report

    def _append_metrics(self, record: dict) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(json_safe(record)) + "\n")


def train(cfg: Config, run_dir: str | Path) -> dict:
    return Trainer(cfg, run_dir).setup().fit()
