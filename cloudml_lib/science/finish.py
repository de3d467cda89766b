"""The end of a run: a stage of its own after training (`finish_run`), over the trained run's best.pt.

1. the best weights (best.pt; where it cannot be used, the final checkpoint's, and best.pt is rewritten with
   them);
2. with model.cloud_head probe, the cloud output fitted on those weights' features of every matched frame of
   the part of the training flights trained on, and put into best.pt with the brightness-temperature
   baseline's fitted flag (for predict --cloud-flag bt_threshold);
3. the validation data scored (they chose the best epoch) and the prediction intervals calibrated on their
   residuals (intervals.json), then the test flights scored once by the route `evaluate` takes
   (evaluate.py): nothing here is chosen on a test flight (a run of the earlier protocol validated on its
   test flights, and keeps that reading, said in its report);
4. what a finished run shows: predictions.csv and the figures, metrics.jsonl's final record, TensorBoard's
   final values, evaluation.json (with the step of the weights it scored: written last, it marks the end as
   done) and report.md.

The probe and the intervals are fitted once, here; `evaluate` of a finished run later re-scores with the
stored ones and changes neither. A run is finished when its final checkpoint says it is trained and its
evaluation.json belongs to that checkpoint's step (status.run_state). Killed anywhere in here, the same
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
from cloudml_lib.core.machine import timing
from cloudml_lib.core.machine.device import choose_device, choose_precision
from cloudml_lib.core.machine.distributed import SINGLE, Dist
from cloudml_lib.core.network.inference import Evaluator, eval_batch_size
from cloudml_lib.core.network.model import build_model
from cloudml_lib.core.run.checkpoint import (
    FORMAT_VERSION,
    Found,
    Key,
    load_checkpoint,
    save_atomic,
    to_cpu,
    weights_sha256,
)
from cloudml_lib.core.run.events import write_final_events
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.progress import Progress
from cloudml_lib.core.run.runfolder import MetricsFile, truncate_metrics
from cloudml_lib.data.dataset import Scalers
from cloudml_lib.science import intervals, plots
from cloudml_lib.science.clouds import fit_probe, fitted_baseline
from cloudml_lib.science.evaluate import (
    EndData,
    Trained,
    load_end_data,
    score,
    test_report,
    trained_of,
    write_evaluation_json,
    write_predictions_and_figure,
)
from cloudml_lib.science.report import format_report, write_report

log = logging.getLogger(__name__)


def finish_run(folder: RunFolder, dist: Dist = SINGLE) -> dict:
    """The end of a trained run, done once: its report. A finished run's stored report is returned as it is
    (report.md written again if it went missing); a run whose end is pending gets it now. Every process of a
    torchrun job calls it (the scoring is shared); rank 0 writes."""
    # rank 0 decides for all (the others would see its lock); a live holder elsewhere is RunLock's to refuse
    state = dist.from_main(folder.state(check_lock=False) if dist.is_main else None)
    if state.kind == "finished":
        report = folder.files.evaluation()
        if not folder.report.is_file() and dist.is_main:
            write_report(folder)
        log.info("This run is finished. Its report:\n%s", format_report(report))
        return report
    if state.kind != "trained":
        raise CloudMLError(f"{folder} is not trained yet ({state.words}): train it first, then its end runs")
    lock = folder.lock() if dist.is_main else None
    if lock is not None:
        attach_run_log(folder)
    try:
        return end_run(folder, folder.trained_checkpoint(), dist, state.why)
    finally:
        if lock is not None:
            lock.release()


def which_run(folder: RunFolder) -> str:
    """The run in words, where it is one of several in a cross-validation or a sweep (their lines share one
    console): "run", "fold 01Mar25's model", "fold 01Mar25's scalars-only control", "trial 3"."""
    if folder.path.parent.parent.name == "folds":
        what = "model" if folder.path.name == "model" else "scalars-only control"
        return f"fold {folder.path.parent.name}'s {what}"
    if folder.path.parent.name == "trials" and folder.path.name.isdigit():
        return f"trial {int(folder.path.name) + 1}"
    return "run"


def end_run(folder: RunFolder, final: Found, dist: Dist, why: str = "not evaluated yet") -> dict:
    """Steps 1-4 above, from the final checkpoint `final`; `why` the end is pending (status.run_state's
    words). Its expected time is said first, and what it took recorded (EndClock)."""
    t0 = time.time()
    cfg = config_from_dict(final.state[Key.CONFIG])
    progress, scalers = Progress.of(final.state), Scalers.from_dict(final.state[Key.SCALERS])
    device = choose_device(cfg.train.device)
    model = build_model(cfg, scalers).to(device).eval()
    data = load_end_data(cfg, scalers, final.state.get(Key.PROVENANCE), final.state.get(Key.SPLIT))
    clock = EndClock(folder, cfg, device, data, t0)
    log.info(
        "The end of the %s (%s): the best model on the validation data, then the test flights%s",
        which_run(folder),
        why,
        clock.expected_words(),
    )
    best, trained = best_weights(folder, model, final, data)  # best.pt read once: changed in memory
    batch = progress.eval_batch_size or eval_batch_size(cfg.train.batch_size)
    evaluator = Evaluator(model, device, choose_precision(device).autocast(device), dist, batch)
    if cfg.model.cloud_head == "probe":
        fit_cloud_probe(evaluator, data, (best, folder.best), dist, progress.step)
    log.info(
        "Scoring the best model on the validation data (%d samples)%s",
        len(data.val_set),
        "" if data.split.legacy else f", then on the test flights ({len(data.test_set)} samples)",
    )
    validation = score(evaluator, data.val_set)
    calibration = calibrate_intervals(cfg, data, validation)
    scored = validation if data.split.legacy else score(evaluator, data.test_set)
    report = test_report(cfg, data, scored, trained, calibration, None if data.split.legacy else validation)
    report["step"] = progress.step
    if dist.is_main:
        weights = weights_sha256(best[Key.MODEL])  # the probe fitted: as best.pt keeps them
        intervals.save(folder, calibration and dict(calibration, weights_sha256=weights))
        keep_cloud_baseline((best, folder.best), data, cfg)
        report["weights_sha256"] = weights
        write_end(folder, final, data, scored, report)
        clock.record()
    dist.barrier()
    epoch = report["best_epoch"]
    log.info("Full test with the best model (epoch %d):\n%s", epoch, format_report(report))
    log.info(
        "Run directory: %s (best.pt, predictions.csv, evaluation.json, plots/); %s",
        folder,
        clock.took_words(),
    )
    return report


class EndClock:
    """The end's expected time (timing.end_seconds: the samples it reads, at this run's measured epoch time
    per sample and the end's share of it) and what it took, kept in run.json's "end" so that the next
    expected time on this kind of device uses it."""

    def __init__(self, folder: RunFolder, cfg, device: torch.device, data: EndData, t0: float):
        self.folder, self.t0, self.device = folder, t0, timing.device_name(device)
        self.samples = len(data.val_set) + (0 if data.split.legacy else len(data.test_set))
        if cfg.model.cloud_head == "probe":
            self.samples += len(data.frames)
        measured = timing.read_measured(self.folder)
        same = measured is not None and measured.get("device") == self.device
        self.per_sample = timing.per_sample(measured, cfg.train.grad_accum_steps) if same else None
        self.scalars_only = bool(cfg.model.scalars_only)
        self.share = timing.end_share(self.folder.path.parent, self.device, self.scalars_only)
        self.expected = (
            None
            if self.per_sample is None
            else timing.end_seconds(self.per_sample, self.samples, self.share[0])
        )
        self.took: float | None = None

    def expected_words(self) -> str:
        if self.expected is None:
            return ""
        return (
            f": about {timing.duration(self.expected)} ({self.samples} samples read at "
            f"{self.share[0]:.2f} of a training sample's time each, {self.share[1]})"
        )

    def record(self) -> None:
        """run.json's "end" (rank 0)."""
        self.took = time.time() - self.t0
        folder = self.folder
        info = folder.files.run_info()
        if info:  # a run.json to add to: every run trained since run.json was written has one
            end = timing.end_record(
                self.expected, self.took, self.samples, self.per_sample, self.device, self.scalars_only
            )
            folder.write_run_info(dict(info, end=end))

    def took_words(self) -> str:
        took = time.time() - self.t0 if self.took is None else self.took
        if self.expected is None:
            return f"the end took {timing.duration(took)}"
        return f"the end took {timing.duration(took)} (expected {timing.duration(self.expected)})"


def calibrate_intervals(cfg, data: EndData, validation) -> dict | None:
    """The intervals calibrated on the validation data's residuals, by train.interval_calibration (each
    validation flight or time block a group); a run of the earlier protocol: on its test flights, pooled, as
    it was."""
    val = data.val_set
    has = val.has_height()
    names = ", ".join(dict.fromkeys(c.name for c in val.caches))
    if data.split.legacy:
        source = f"this run's held-out flights ({names})"
        return intervals.calibrate(
            validation.height_km[has], val.targets_km()[has], METHOD, cfg.train.interval_coverage, source
        )
    return intervals.calibrate(
        validation.height_km[has],
        val.targets_km()[has],
        METHOD,
        cfg.train.interval_coverage,
        f"the validation data of the training flights ({names}; no test flight)",
        groups=val.flight_names()[has],
        mode=cfg.train.interval_calibration,
    )


METHOD = "conformal_absolute"  # a run's intervals; cross-validation measures both methods on unseen flights


def best_weights(
    folder: RunFolder, model: torch.nn.Module, final: Found, data: EndData
) -> tuple[dict, Trained]:
    """best.pt's weights into `model`; best.pt itself (its checkpoint, which the end keeps in memory and
    saves as it changes it: read once, however large) and its record of the training (evaluate.trained_of).
    Where best.pt cannot be used, the final checkpoint's weights, and best.pt rewritten with them."""
    best = folder.best
    try:
        ckpt = load_checkpoint(best)
        model.load_state_dict(ckpt[Key.MODEL])
        return ckpt, trained_of(ckpt, data)
    except (CloudMLError, RuntimeError, KeyError, TypeError, ValueError) as e:
        progress = Progress.of(final.state)
        log.warning(
            "%s cannot be used (%s). The end of the run uses the newest weights (epoch %d) instead, and "
            "best.pt is rewritten with them.",
            best,
            str(e).splitlines()[0] if str(e) else type(e).__name__,
            progress.epoch,
        )
        # the weights the run validates: their average where it keeps one (train/averaging.py)
        model.load_state_dict((final.state.get(Key.EMA) or {}).get("weights") or final.state[Key.MODEL])
        train_mean = float(np.nanmean(data.frames.targets_km()))
        ckpt = {
            Key.FORMAT: FORMAT_VERSION,
            Key.MODEL: to_cpu(dict(model.state_dict())),
            Key.CONFIG: final.state[Key.CONFIG],
            Key.SCALERS: final.state[Key.SCALERS],
            Key.EPOCH: progress.epoch,
            Key.STEP: progress.step,
            Key.VAL_LOSS: float("nan"),
            Key.TRAIN_MEAN_KM: train_mean,
            Key.PROVENANCE: final.state.get(Key.PROVENANCE),
            **{k: final.state[k] for k in (Key.LABEL_RANGE, Key.SPLIT, Key.DOMAIN) if k in final.state},
        }
        save_atomic(ckpt, best)
        return ckpt, trained_of(ckpt, data)


def fit_cloud_probe(
    evaluator: Evaluator, data: EndData, best: tuple[dict, Path], dist: Dist, step: int
) -> None:
    """model.cloud_head probe: the cloud output fitted on the loaded (best) weights' features of every frame
    of the part of the training flights trained on that a CPL profile matches (clear sky and cloud without a
    height included; no augmentation), on the cloud classes (data.cloud_flag base_in_range) or the flag
    (any_layer), put in the model and into best.pt with the final `step` of the training it ends. Fitted
    once: an end interrupted after this (the probe in best.pt for this step) keeps it, with no second pass
    over the training flights; best.pt of an earlier end (a run trained further since) is fitted again.
    `best`: best.pt's checkpoint as the end holds it, and its path."""
    (ckpt, path), model, frames = best, evaluator.model, data.frames
    stored = ckpt.get(Key.PROBE_STEP)  # None: not recorded (an earlier release's best.pt)
    kept = bool(int(getattr(model, "cloud_fitted", 0))) and isinstance(stored, int) and stored == step
    if dist.from_main(kept if dist.is_main else None):  # one way for every process (the pass is shared)
        log.info("Cloud / no-cloud output: the one fitted for step %d, kept from %s", step, path)
        return
    log.info(  # the end's longest pass on a real flight set (about a minute): said before, timed after
        "Cloud / no-cloud output: reading the trained network's features of the %d frames of the training "
        "flights, then fitting it",
        len(frames),
    )
    t0 = time.perf_counter()
    features, _ = evaluator.outputs(frames, np.arange(len(frames)), features=True)
    flags, classes = frames.cloud_flags(), model.cloud.out_features
    fitted = fit_probe(features, frames.cloud_classes() if classes > 1 else flags, classes)
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
    model.set_cloud_probe(
        torch.as_tensor(weight, dtype=model.cloud.weight.dtype), bias if classes > 1 else bias[0]
    )
    log.info(
        "Cloud / no-cloud output fitted on the trained network's features (logistic regression) over %d "
        "frames of the training flights (%d clear sky) in %.1f s",
        len(flags),
        int((flags == 0).sum()),
        time.perf_counter() - t0,
    )
    ckpt[Key.MODEL] = to_cpu(dict(model.state_dict()))
    ckpt[Key.PROBE_STEP] = step
    if dist.is_main:
        save_atomic(ckpt, path)
    faults.point("probe-fitted")


def keep_cloud_baseline(best: tuple[dict, Path], data: EndData, cfg) -> None:
    """The brightness-temperature baseline's flag, fitted on the frames trained on, into best.pt (predict
    --cloud-flag bt_threshold writes it); best.pt left as it is where it already holds the same. `best`:
    best.pt's checkpoint as the end holds it, and its path."""
    train = {"flag": data.frames.cloud_flags(), "p10": data.frames.frame_p10()}
    fitted = {**fitted_baseline(train, cfg.data.cloud_flag == "base_in_range"), "flag": cfg.data.cloud_flag}
    stated = {(c.radiometry.units, c.radiometry.scale, c.radiometry.offset) for c in data.frames.caches}
    if len(stated) == 1:  # the numbers it thresholds are the IR files' stored ones: say what they are
        ((units, scale, offset),) = stated
        fitted.update(units=units, scale=float(scale), offset=float(offset))
    ckpt, path = best
    if ckpt.get(Key.CLOUD_BASELINE) != fitted:
        ckpt[Key.CLOUD_BASELINE] = fitted
        save_atomic(ckpt, path)


def write_end(folder: RunFolder, final: Found, data: EndData, scored, report: dict) -> None:
    """Rank 0's files of the end; evaluation.json, which marks the end as done, after all but report.md."""
    progress = Progress.of(final.state)
    write_predictions_and_figure(folder, data.test_set, scored, report)
    metrics = MetricsFile(folder, SINGLE)
    truncate_metrics(metrics.path, final.state[Key.METRICS_BYTES])  # an end run again: one final record
    metrics.append(
        {
            "kind": "final",
            "epoch": progress.epoch,
            "step": progress.step,
            **report["overall"],
            "baseline": report["baseline"],
            "per_flight": report["per_flight"],
        }
    )
    if progress.history:
        plots.save_figure(plots.curves_figure(progress.history), folder.plots / "curves.png")
    scatter = plots.image_pixels(folder.plots / "scatter.png")  # TensorBoard's image, read here
    write_final_events(
        folder,
        progress.step,
        {f"final/{k}": v for k, v in report["overall"].items()},
        {} if scatter is None else {"evaluation/scatter": scatter},
    )
    faults.point("end-written")
    write_evaluation_json(folder, report)
    write_report(folder)
