"""What the outside sees of a running run: run.json (the plan of this start and what torch.compile did),
provenance.json, the step records of metrics.jsonl, and the `@progress` lines the notebook's bar follows."""

from __future__ import annotations

import json
import logging
import os
import time

import torch

from cloudml_lib.base.outputs import json_safe
from cloudml_lib.core.machine.distributed import Dist
from cloudml_lib.core.machine.timing import Measured, combined, expected_from_env, segments_of
from cloudml_lib.core.network.compile import CompileWatch
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.provenance import write_run_provenance

log = logging.getLogger(__name__)


class ProgressLines:
    """With CLOUDML_PROGRESS=1 (the notebook's training subprocess), one `@progress {json}` line on stdout
    after an optimizer step, at most twice a second: the notebook's bar follows every step, not only the
    logged ones, while tqdm's own bar is off (TQDM_DISABLE=1)."""

    PREFIX, EVERY_S = "@progress ", 0.5

    def __init__(self, enabled: bool):
        self.enabled, self.last = enabled, 0.0

    def __call__(self, state, total: int, epochs: int, batches: int) -> None:
        if not self.enabled or time.monotonic() - self.last < self.EVERY_S:
            return
        self.last = time.monotonic()
        try:
            print(
                self.PREFIX
                + json.dumps(
                    {
                        "step": state.step,
                        "total": total,
                        "epoch": state.epoch + 1,
                        "epochs": epochs,
                        "batch": state.batch,
                        "batches": batches,
                    }
                ),
                flush=True,
            )
        except OSError:  # the notebook is gone (a closed pipe): training goes on without it
            self.enabled = False


class RunInfo:
    """run.json: the plan of this (re)start, for progress bars and monitors, and what torch.compile did
    (rewritten at each start, after the first step and at each epoch's end). Only rank 0 writes."""

    def __init__(
        self,
        folder: RunFolder,
        dist: Dist,
        watch: CompileWatch,
        provenance: dict,
        measured: Measured | None = None,
    ):
        self.folder, self.dist, self.watch, self.provenance = folder, dist, watch, provenance
        self.measured = measured  # what this start's epochs take (core/machine/timing.py)
        self.plan: dict = {}
        self.earlier: list[dict] = []  # the segments of the run's earlier starts
        self.segment: dict = {"start_step": None, "started_at": None, "expected": None}
        self.compile_said = False

    def start(self, plan: dict, resumed: bool) -> None:
        """At set-up: the plan of this start; provenance.json when resuming or when it is missing. Each start
        is a segment of the run: the estimate the notebook started it from, if any, and what its epochs took;
        a resumed run keeps its earlier segments (its first expected time included)."""
        self.earlier = segments_of(self.folder.files.run_info()) if resumed else []
        self.segment = {
            "start_step": plan.get("start_step"),
            "started_at": time.time(),
            "expected": expected_from_env(os.environ),
        }
        self.plan = dict(plan, started_at=self.segment["started_at"])
        self.write(provenance=resumed)

    def epoch_done(self, seconds: float, steps: int, full: bool, memory: dict) -> None:
        """An epoch's time and memory into run.json's "measured" (written by the next write)."""
        if self.measured is not None:
            self.measured.epoch(seconds, steps, full, memory)
        if self.dist.is_main:  # what validation compiled, kept for the next session
            self.watch.keep_cache()

    def write(self, provenance: bool = False) -> None:
        """run.json; provenance.json too when asked or when it went missing."""
        if not self.dist.is_main:
            return
        info = dict(self.plan, compile=self.watch.update().to_dict())
        this = dict(self.segment, measured=self.measured.record() if self.measured is not None else None)
        segments = [*self.earlier, this]
        info["segments"] = segments
        # the run's first expected time, and what all its epochs on this device took
        info["expected"] = next((s["expected"] for s in segments if s["expected"]), None)
        measured = combined([s["measured"] for s in segments])
        if measured is not None:
            info["measured"] = measured
        self.folder.write_run_info(info)
        if provenance or not self.folder.provenance.is_file():
            write_run_provenance(self.folder, json_safe(self.provenance))

    def report_compile(self) -> None:
        """After this start's first step (when compiling happened): say what was compiled, once."""
        if self.compile_said or not (self.watch.report.requested or self.watch.report.fallback):
            return
        self.compile_said = True
        report = self.watch.update()
        (log.info if report.active else log.warning)("torch.compile: %s", report.describe())
        if self.dist.is_main:
            self.watch.keep_cache()
        self.write()


def log_step(loop, optimizer, metrics, events, epoch: int, bar) -> None:
    """A metrics.jsonl step record, TensorBoard's step scalars and the progress bar's postfix, from the loop's
    window sums (one device sync per log interval)."""
    acc, dist = loop.acc, loop.dist
    loss_sum, batches, samples = dist.all_sum(
        torch.stack(
            [
                acc["window_loss"],
                acc["window_batches"].float(),
                torch.tensor(float(acc["window_samples"]), device=loop.device),
            ]
        )
    ).tolist()
    rate = samples / max(1e-9, time.time() - loop.window_t0)
    record = {
        "kind": "step",
        "epoch": epoch + 1,
        "step": loop.progress.step,
        "loss": loss_sum / max(1.0, batches / dist.world),
        "lr": optimizer.param_groups[0]["lr"],
        "samples_per_s": rate,
        "time": time.time(),
    }
    metrics.append(record)
    events.scalars(
        record["step"], {"train/loss": record["loss"], "train/lr": record["lr"], "train/samples_per_s": rate}
    )
    bar.set_postfix(loss=f"{record['loss']:.3f}", samples_s=f"{rate:.1f}")
    loop.reset_window()


def mean_loss(dist: Dist, loss_sum: torch.Tensor, batches: torch.Tensor) -> float:
    """Mean batch loss: each process holds its parts of the global batches' losses."""
    total, count = dist.all_sum(torch.stack([loss_sum, batches.float()])).tolist()
    return total / max(1.0, count / dist.world)
