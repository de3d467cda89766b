"""The end of a run: a stage of its own after training (`finish_run`), over the trained run's best.pt.

1. the best weights (best.pt; where it cannot be used, the final checkpoint's, and best.pt is rewritten with
   them);
2. with model.cloud_head probe, the cloud output fitted on those weights' features of every matched frame of
   the training flights, and put into best.pt;
3. the held-out flights scored by the route `evaluate` takes (evaluate.py), and the prediction intervals
   calibrated on them (intervals.json);
4. what a finished run shows: predictions.csv and the figures, metrics.jsonl's final record, TensorBoard's
   final values, evaluation.json (with the step of the weights it scored: written last, it marks the end as
   done) and report.md.

The probe and the intervals are fitted once, here; `evaluate` of a finished run later re-scores with the
stored ones and changes neither. A run is finished when its final checkpoint says it is trained and its
evaluation.json belongs to that checkpoint's step (rundir.run_state). Killed anywhere in here, the same
command runs the end again and writes the same files: every step is deterministic.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from cloudml_lib.base import faults
from cloudml_lib.base.config import config_from_dict
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.base.logs import attach_run_log
from cloudml_lib.core.checkpoint import FORMAT_VERSION, Found, Key, load_checkpoint, save_atomic, to_cpu
from cloudml_lib.core.device import choose_device, choose_precision
from cloudml_lib.core.distributed import SINGLE, Dist
from cloudml_lib.core.events import write_final_events
from cloudml_lib.core.inference import Evaluator, eval_batch_size
from cloudml_lib.core.model import build_model
from cloudml_lib.core.rundir import MetricsFile, run_state, trained_checkpoint, truncate_metrics
from cloudml_lib.core.runlock import RunLock
from cloudml_lib.data.dataset import Scalers
from cloudml_lib.science import intervals, plots
from cloudml_lib.science.clouds import fit_probe
from cloudml_lib.science.evaluate import (
    HeldOut,
    format_report,
    held_out_report,
    load_held_out,
    read_evaluation,
    score,
    write_evaluation_json,
    write_predictions_and_figure,
)
from cloudml_lib.science.report import write_report

log = logging.getLogger(__name__)


def finish_run(run_dir: str | Path, dist: Dist = SINGLE) -> dict:
    """The end of a trained run, done once: its report. A finished run's stored report is returned as it is
    (report.md written again if it went missing); a run whose end is pending gets it now. Every process of a
    torchrun job calls it (the scoring is shared); rank 0 writes."""
    run_dir = Path(run_dir)
    # rank 0 decides for all (the others would see its lock); a live holder elsewhere is RunLock's to refuse
    state = dist.from_main(run_state(run_dir, check_lock=False) if dist.is_main else None)
    if state.kind == "finished":
        report = read_evaluation(run_dir)
        if not (run_dir / "report.md").is_file() and dist.is_main:
            write_report(run_dir)
        log.info("This run is finished. Its report:\n%s", format_report(report))
        return report
    if state.kind != "trained":
        raise CloudMLError(f"{run_dir} is not trained yet ({state.words}): train it first, then its end runs")
    lock = RunLock(run_dir) if dist.is_main else None
    if lock is not None:
        lock.acquire()
        attach_run_log(run_dir)
    try:
        log.info("The end of the run (%s): scoring the best model on the held-out flights", state.why)
        return end_run(run_dir, trained_checkpoint(run_dir), dist)
    finally:
        if lock is not None:
            lock.release()


def end_run(run_dir: Path, final: Found, dist: Dist) -> dict:
    """Steps 1-4 above, from the final checkpoint `final`."""
    cfg = config_from_dict(final.state[Key.CONFIG])
    progress, scalers = final.state[Key.LOOP], Scalers.from_dict(final.state[Key.SCALERS])
    device = choose_device(cfg.train.device)
    model = build_model(cfg, scalers).to(device).eval()
    held = load_held_out(cfg, scalers, final.state.get(Key.PROVENANCE))
    best = best_weights(run_dir, model, final, held)
    batch = progress.get("eval_batch_size") or eval_batch_size(cfg.train.batch_size)
    evaluator = Evaluator(model, device, choose_precision(device).autocast(device), dist, batch)
    if cfg.model.cloud_head == "probe":
        fit_cloud_probe(evaluator, held, run_dir / "best.pt", dist, progress["step"])
    scored = score(evaluator, held.val_set)
    has = held.val_set.has_height()
    names = ", ".join(c.name for c in held.val_set.caches)
    calibration = intervals.calibrate(
        scored.height_km[has],
        held.val_set.targets_km()[has],
        "conformal_absolute",
        cfg.train.interval_coverage,
        f"this run's held-out flights ({names})",
    )
    report = held_out_report(cfg, held, scored, best, calibration)
    report["step"] = progress["step"]
    if dist.is_main:
        intervals.save(run_dir, calibration)
        write_end(run_dir, final, held, scored, report)
    dist.barrier()
    epoch = report["best_epoch"]
    log.info("Full validation with the best model (epoch %d):\n%s", epoch, format_report(report))
    log.info("Run directory: %s (best.pt, predictions.csv, evaluation.json, plots/)", run_dir)
    return report


def best_weights(run_dir: Path, model: torch.nn.Module, final: Found, held: HeldOut) -> tuple[float, int]:
    """best.pt's weights into `model`; (the training flights' mean height in km, the best epoch). Where
    best.pt cannot be used, the final checkpoint's weights, and best.pt rewritten with them."""
    best = run_dir / "best.pt"
    try:
        ckpt = load_checkpoint(best)
        model.load_state_dict(ckpt[Key.MODEL])
        return float(ckpt[Key.TRAIN_MEAN_KM]), int(ckpt[Key.EPOCH])
    except (CloudMLError, RuntimeError, KeyError, TypeError, ValueError) as e:
        progress = final.state[Key.LOOP]
        log.warning(
            "%s cannot be used (%s). The end of the run uses the newest weights (epoch %d) instead, and "
            "best.pt is rewritten with them.",
            best,
            str(e).splitlines()[0] if str(e) else type(e).__name__,
            progress["epoch"],
        )
        model.load_state_dict(final.state[Key.MODEL])
        train_mean = float(np.nanmean(held.frames.targets_km()))
        save_atomic(
            {
                Key.FORMAT: FORMAT_VERSION,
                Key.MODEL: to_cpu(dict(model.state_dict())),
                Key.CONFIG: final.state[Key.CONFIG],
                Key.SCALERS: final.state[Key.SCALERS],
                Key.EPOCH: progress["epoch"],
                Key.STEP: progress["step"],
                Key.VAL_LOSS: float("nan"),
                Key.TRAIN_MEAN_KM: train_mean,
                Key.PROVENANCE: final.state.get(Key.PROVENANCE),
            },
            best,
        )
        return train_mean, int(progress["epoch"])


def fit_cloud_probe(evaluator: Evaluator, held: HeldOut, best: Path, dist: Dist, step: int) -> None:
    """model.cloud_head probe: the cloud output fitted on the loaded (best) weights' features of every frame
    of the training flights that a CPL profile matches (clear sky and cloud without a height included; no
    augmentation), put in the model and into best.pt with the final `step` of the training it ends. Fitted
    once: an end interrupted after this (the probe in best.pt for this step) keeps it, with no second pass
    over the training flights; best.pt of an earlier end (a run trained further since) is fitted again."""
    model, frames = evaluator.model, held.frames
    kept = bool(int(getattr(model, "cloud_fitted", 0))) and stored_probe_step(best) == step
    if dist.from_main(kept if dist.is_main else None):  # one way for every process (the pass is shared)
        log.info("Cloud / no-cloud output: the one fitted for step %d, kept from %s", step, best)
        return
    t0 = time.perf_counter()
    features, _ = evaluator.outputs(frames, np.arange(len(frames)), features=True)
    flags = frames.cloud_flags()
    fitted = fit_probe(features, flags)
    if fitted is None:
        log.warning(
            "The cloud / no-cloud output cannot be fitted: the training flights' %d matched frames are all "
            "%s. The model answers heights only (predict flags no frame). Add a flight with %s frames to "
            "train it.",
            len(flags),
            "cloudy" if flags.all() else "clear",
            "clear-sky" if flags.all() else "cloudy",
        )
        return
    weight, bias = fitted
    model.set_cloud_probe(torch.as_tensor(weight, dtype=model.cloud.weight.dtype), bias)
    log.info(
        "Cloud / no-cloud output fitted on the trained network's features (logistic regression) over %d "
        "frames of the training flights (%d clear sky) in %.1f s",
        len(flags),
        int((flags == 0).sum()),
        time.perf_counter() - t0,
    )
    if dist.is_main and best.exists():
        ckpt = load_checkpoint(best)
        ckpt[Key.MODEL] = to_cpu(dict(model.state_dict()))
        ckpt[Key.PROBE_STEP] = step
        save_atomic(ckpt, best)
    faults.point("probe-fitted")


def stored_probe_step(best: Path) -> int | None:
    """The step best.pt's cloud probe was fitted for (None: not recorded, e.g. by an earlier release, or
    best.pt unreadable)."""
    try:
        found = load_checkpoint(best).get(Key.PROBE_STEP)
    except (CloudMLError, OSError, RuntimeError):
        return None
    return int(found) if isinstance(found, int) else None


def write_end(run_dir: Path, final: Found, held: HeldOut, scored, report: dict) -> None:
    """Rank 0's files of the end; evaluation.json, which marks the end as done, after all but report.md."""
    progress = final.state[Key.LOOP]
    write_predictions_and_figure(run_dir, held.val_set, scored, report)
    metrics = MetricsFile(run_dir, SINGLE)
    truncate_metrics(metrics.path, final.state[Key.METRICS_BYTES])  # an end run again: one final record
    metrics.append(
        {
            "kind": "final",
            "epoch": progress["epoch"],
            "step": progress["step"],
            **report["overall"],
            "baseline": report["baseline"],
            "per_flight": report["per_flight"],
        }
    )
    if progress["history"]:
        plots.save_figure(plots.curves_figure(progress["history"]), run_dir / "plots" / "curves.png")
    write_final_events(
        run_dir,
        progress["step"],
        {f"final/{k}": v for k, v in report["overall"].items()},
        {"evaluation/scatter": run_dir / "plots" / "scatter.png"},
    )
    faults.point("end-written")
    write_evaluation_json(run_dir, report)
    write_report(run_dir)
