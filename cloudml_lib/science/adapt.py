"""Adaptation to a new flight with a few of its labels, scored honestly.

A trained network often fails on a flight of another regime; a few labelled heights of that flight recover
much of the skill (the users' own finding: 50 labels brought R2 from below 0 to 0.57-0.85). This module says
how much, without flattering it:

- **The first N labels in time** (labels, not frames) are the adaptation block; the rest of the flight is the
  only part scored, and only from a gap after the block's last label: neighbouring frames see the same cloud,
  so a label a few seconds after the block is no new case. The gap is the e-folding lag of the flight's own
  brightness (the mean of each CPL-matched frame, an input: no label of the scored part is looked at), in
  frames, at least GAP_FLOOR_FRAMES and at most a quarter of the flight. Every N is scored on the same frames:
  those after the largest N's block and the gap.
- **The network**: its head (the layers after the frame encoder, on the pooled features and the scalars) is
  fine-tuned on the N labels for a fixed ADAPT_STEPS full-batch Adam steps at the run's learning rate, with an
  L2 pull (ANCHOR) towards the trained head so that a few labels move it little; the frame encoder stays as
  trained. Nothing is chosen: no epoch, no learning rate, no stop on any score.
- **The baselines get the same N labels**: each, fitted on the training flights as in the report, has its mean
  error on the N labels removed (the training mean so becomes the mean of the flight's own N labels).
- **The intervals** are calibrated on the same N labels, by cross-fitting: the N are cut into FOLDS runs in
  time, the head fine-tuned without each run predicts it, and those out-of-fold errors calibrate the interval
  (the run's method, intervals.py) around the head fine-tuned on all N; the wider of that and the run's own
  calibration is taken, because a few labels early in a flight cannot tell how its errors spread later (the
  out-of-fold calibration alone held 59-71 % for a 90 % target on the demo). Below
  intervals.MIN_CALIBRATION labels the run's calibration alone; N = 0 keeps the run's.
- **The verdict** at each N compares the adapted network with the best adapted baseline on the scored part by
  the paired MAE difference over time blocks (metrics.mae_difference): "better" or "worse" only where its
  interval excludes zero, else "level".

`crossval` draws the curve for every test flight (its fold's model; train.adaptation_labels), and the Python
API's `adapt` does it for a user's own flight (`cloudml_lib.api`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from cloudml_lib.base.config import Config
from cloudml_lib.base.runfiles import INTERVAL_METHODS
from cloudml_lib.core.network.inference import predict
from cloudml_lib.core.network.metrics import mae_difference, regression_metrics
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.data.dataset import CloudDataset
from cloudml_lib.data.preprocess import STAT_NAMES
from cloudml_lib.science import baselines, intervals

ADAPT_STEPS = 100  # full-batch Adam steps of the head on the N labels (fixed: nothing is chosen)
ANCHOR = 1e-2  # weight of the squared distance of the head's weights from the trained head's
GAP_FLOOR_FRAMES = 30  # about half a minute of IR frames: the gap is never shorter
GAP_MOST = 0.25  # nor longer than this share of the flight's CPL-matched frames
FOLDS = 5  # runs in time the N labels are cut into for the intervals' out-of-fold errors
MIN_SCORED = 20  # fewer labels after the gap: the flight cannot be scored at that N


@dataclass
class Labelled:
    """One flight's labelled samples in time order: their positions in the flight's dataset, IR frame
    indices, heights (km), standardised heights and the head's input (features) of each."""

    rows: np.ndarray
    frames: np.ndarray
    true_km: np.ndarray
    target: np.ndarray
    features: np.ndarray


def gap_frames(dataset: CloudDataset) -> tuple[int, str]:
    """The gap (IR frames) between the adaptation block and the scored part, and how it was found: the lag at
    which the autocorrelation of the flight's frame-mean brightness first falls below 1/e."""
    cache = dataset.caches[0]
    order = np.argsort(cache.frame_index, kind="stable")
    frames = np.asarray(cache.frame_index)[order]
    series = np.asarray(cache.frame_stats, np.float64)[order, STAT_NAMES.index("mean")]
    most = (
        max(GAP_FLOOR_FRAMES, int(GAP_MOST * (frames[-1] - frames[0]))) if frames.size else GAP_FLOOR_FRAMES
    )
    x = np.where(np.isfinite(series), series, np.nanmean(series) if np.isfinite(series).any() else 0.0)
    x = x - x.mean()
    if x.size < 3 or not (x**2).sum() > 0:
        return (
            GAP_FLOOR_FRAMES,
            f"the floor of {GAP_FLOOR_FRAMES} frames (the flight's brightness does not vary)",
        )
    spacing = float(np.median(np.diff(frames))) if frames.size > 1 else 1.0
    acf = np.correlate(x, x, mode="full")[x.size - 1 :] / (x**2).sum()
    below = np.flatnonzero(acf < 1 / np.e)
    lag = int(round((below[0] if below.size else x.size) * max(spacing, 1.0)))
    gap = int(min(max(lag, GAP_FLOOR_FRAMES), most))
    why = f"the e-folding lag of the flight's brightness, {lag} frames"
    if gap != lag:
        why += (
            f", raised to the floor of {GAP_FLOOR_FRAMES}"
            if lag < gap
            else ", cut to a quarter of the flight"
        )
    return gap, why


def labelled(model: torch.nn.Module, dataset: CloudDataset, device, batch: int) -> Labelled:
    """The flight's labelled samples in time order with the network's head input for each (one pass)."""
    rows = np.flatnonzero(dataset.has_height())
    rows = rows[np.argsort(dataset.frame_indices()[rows], kind="stable")]
    feats, target = predict(model, dataset, device, batch, indices=rows, features=True)
    return Labelled(
        rows, dataset.frame_indices()[rows], dataset.targets_km()[rows], np.asarray(target), np.asarray(feats)
    )


def fit_head(model: torch.nn.Module, features: np.ndarray, target: np.ndarray, train, seed: int):
    """A copy of the model's head fine-tuned on (features, standardised target): ADAPT_STEPS full-batch Adam
    steps at train.learning_rate, Huber (train.huber_delta) plus ANCHOR times the squared distance from the
    trained head; on the CPU, in float32, the same for the same input."""
    head = copy.deepcopy(model.head).to("cpu").float().train()
    start = [p.detach().clone() for p in head.parameters()]
    x = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(target, dtype=torch.float32)
    optimizer = torch.optim.Adam(head.parameters(), lr=train.learning_rate)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(ADAPT_STEPS):
            optimizer.zero_grad(set_to_none=True)
            height = model.height(head(x)[:, 0])
            pull = sum(((p - p0) ** 2).sum() for p, p0 in zip(head.parameters(), start))
            loss = torch.nn.functional.huber_loss(height, y, delta=train.huber_delta) + ANCHOR * pull
            loss.backward()
            optimizer.step()
    return head.eval()


def head_km(model: torch.nn.Module, head, features: np.ndarray, scalers) -> np.ndarray:
    """Heights (km) from the head's input through `head` (the model's own, or a fine-tuned copy)."""
    head = copy.deepcopy(model.head).to("cpu").float().eval() if head is None else head
    with torch.no_grad():
        raw = head(torch.as_tensor(features, dtype=torch.float32))[:, 0]
        height = model.height(raw).double().numpy()
    return height * scalers.cbh_std + scalers.cbh_mean


def plan(frames: np.ndarray, ns: list[int], gap: int) -> tuple[list[int], int, dict]:
    """The Ns the flight can show (each leaving MIN_SCORED labels after the largest block and the gap), the
    position of the first scored label, and each N left out with the reason."""
    kept, left = sorted({int(n) for n in ns if n > 0}), {}
    while kept:
        start = (
            int(np.searchsorted(frames, frames[kept[-1] - 1] + gap, side="right"))
            if kept[-1] <= frames.size
            else frames.size
        )
        if frames.size - start >= MIN_SCORED:
            return kept, start, left
        n = kept.pop()
        left[n] = (
            f"the flight has {frames.size} labels: {n} and a gap of {gap} frames leave fewer than "
            f"{MIN_SCORED} to score"
        )
    return [], 0, left


def too_few(labels: int, ns: list[int]) -> dict | None:
    """Each N a flight of `labels` labels cannot show even before its gap (N to adapt on and MIN_SCORED to
    score), as curve's record says it; None where some N might fit (the gap decides: plan)."""
    wanted = sorted({int(n) for n in ns if n > 0})
    if not wanted or labels >= wanted[0] + MIN_SCORED:
        return None
    why = (
        f"the flight has {labels} labels: {{n}} to adapt on and {MIN_SCORED} to score need {{need}} at least"
    )
    return {
        "labels": int(labels),
        "left_out": {str(n): why.format(n=n, need=n + MIN_SCORED) for n in wanted},
        "curve": [],
    }


def interval_calibration(model, scalers, lab: Labelled, n: int, run: tuple):
    """A calibration (intervals.calibrate) from the out-of-fold errors of the first `n` labels: each of FOLDS
    runs in time predicted by the head fine-tuned on the others; None below intervals.MIN_CALIBRATION."""
    train, seed, _, method, coverage = run
    if n < intervals.MIN_CALIBRATION:
        return None
    pred = np.empty(n)
    for part in np.array_split(np.arange(n), min(FOLDS, n)):
        rest = np.setdiff1d(np.arange(n), part)
        head = fit_head(model, lab.features[rest], lab.target[rest], train, seed)
        pred[part] = head_km(model, head, lab.features[part], scalers)
    source = f"the out-of-fold errors of the flight's first {n} labels ({min(FOLDS, n)} runs in time)"
    return intervals.calibrate(pred, lab.true_km[:n], method, coverage, source)


def curve(
    model: torch.nn.Module,
    scalers,
    lab: Labelled,
    fitted: dict,
    ns: list[int],
    gap: tuple[int, str],
    run: tuple,
) -> tuple[dict, dict]:
    """The flight's skill against the number of its labels adapted on (0 and each of `ns`), on the same scored
    part: the network, each baseline (`fitted`: name -> heights of the labelled samples, in lab's order) and
    the intervals; with the fine-tuned heads by N (for the tests). `run`: (train config, seed, calibration or
    None, interval method, coverage)."""
    train, seed, calibration = run[:3]
    kept, start, left = plan(lab.frames, ns, gap[0])
    record = {
        "labels": int(lab.frames.size),
        "gap_frames": gap[0],
        "gap_from": gap[1],
        "left_out": {str(n): why for n, why in sorted(left.items())},
        "curve": [],
    }
    if not kept:
        return record, {}
    scored = np.arange(start, lab.frames.size)
    true = lab.true_km[scored]
    record.update(scored_labels=int(scored.size), scored_from_frame=int(lab.frames[start]))
    heads = {}
    for n in [0, *kept]:
        head = fit_head(model, lab.features[:n], lab.target[:n], train, seed) if n else None
        heads[n] = head
        net = head_km(model, head, lab.features[scored], scalers)
        point = {"n": n, "network": regression_metrics(true, net), "baselines": {}}
        for name, pred in fitted.items():
            point["baselines"][name] = regression_metrics(true, adapted(pred, lab, n)[scored])
        point.update(against_best(point, net, fitted, n, lab, start))
        point["intervals"] = adapted_intervals(model, scalers, lab, n, run, net, true)
        record["curve"].append(point)
    return record, heads


def adapted_intervals(model, scalers, lab: Labelled, n: int, run: tuple, net: np.ndarray, true: np.ndarray):
    """The intervals' coverage and width on the scored part at N = n: the run's calibration at 0; above, the
    wider of the run's and the N labels' out-of-fold calibration (interval_calibration), since a few labels
    early in a flight cannot tell how its errors spread later (measured: benchmarks/results/adaptation.json).
    None where neither exists."""
    calibrations = [c for c in (run[2], n and interval_calibration(model, scalers, lab, n, run)) if c]
    if not calibrations:
        return None
    bounds = [intervals.bounds(net, c) for c in calibrations]
    low, high = np.minimum.reduce([b[0] for b in bounds]), np.maximum.reduce([b[1] for b in bounds])
    used = ["the run's"] * (run[2] is not None) + [f"the first {n} labels' out-of-fold"] * (
        len(calibrations) > (run[2] is not None)
    )
    return {
        **intervals.scores(true, low, high),
        "target": float(calibrations[0]["coverage"]),
        "calibrated_on": " and ".join(used),
    }


def against_best(point: dict, net, fitted: dict, n: int, lab: Labelled, start: int) -> dict:
    """The best adapted baseline on the scored part (lowest MAE) and the adapted network against it: the
    paired MAE difference over time blocks and the call, better / worse only where its interval excludes 0."""
    maes = {k: m["mae_km"] for k, m in point["baselines"].items() if m.get("mae_km") is not None}
    if not maes:
        return {"best_baseline": None, "against_best": None}
    name = min(maes, key=maes.get)
    diff = mae_difference(lab.true_km[start:], net, adapted(fitted[name], lab, n)[start:], lab.frames[start:])
    if diff is None:
        return {"best_baseline": name, "against_best": None}
    low, high = diff["interval_km"]
    call = "better" if high < 0 else "worse" if low > 0 else "level"
    return {"best_baseline": name, "against_best": {**diff, "call": call}}


def adapted(pred: np.ndarray, lab: Labelled, n: int) -> np.ndarray:
    """A baseline's heights with its mean error on the first `n` labels removed (as they are for n = 0)."""
    return pred - (float(np.nanmean(pred[:n] - lab.true_km[:n])) if n else 0.0)


def flight_curve(
    model: torch.nn.Module,
    cfg: Config,
    flight: CloudDataset,
    train: CloudDataset,
    calibration: dict | None,
    device=None,
) -> tuple[dict, dict]:
    """The adaptation curve (curve) of one flight (`flight`: its samples alone, with the run's scalers) for a
    trained model and its config, the baselines fitted on `train` (the run's training part) as the report
    fits them, and the run's interval `calibration` (None: no interval at N = 0)."""
    from cloudml_lib.core.network.inference import eval_batch_size

    device = device or next(model.parameters()).device
    lab = labelled(model, flight, device, eval_batch_size(cfg.train.batch_size))
    fitted = baselines.fit_predict(train, [flight], cfg.train.seed, cfg.data)
    heights = {k: v[0][lab.rows] for k, v in fitted.heights.items()}
    method = (calibration or {}).get("method") or INTERVAL_METHODS[0]
    run = (cfg.train, cfg.train.seed, calibration, method, cfg.train.interval_coverage)
    ns = list(cfg.train.adaptation_labels)
    record, heads = curve(model, flight.scalers, lab, heights, ns, gap_frames(flight), run)
    record["baselines_left_out"] = dict(fitted.left_out)
    return record, heads


def adapt_run(
    folder: RunFolder, flight: str | None = None, labels=(10, 25, 50), data_dir: str | None = None
) -> dict:
    """The adaptation curve of a finished run on one flight it never trained on (default: its first test
    flight; or a new flight found in its data folder): `labels`, the Ns; nothing is written. The record of
    `flight_curve`, with the flight's name, its role in the run and the curve in words (`words`)."""
    from cloudml_lib.base.config import derive
    from cloudml_lib.base.errors import CloudMLError
    from cloudml_lib.core.run.checkpoint import Key, weights_sha256
    from cloudml_lib.data import predictors
    from cloudml_lib.data.cache import load_flight_cache
    from cloudml_lib.data.dataset import Scalers, flag_range
    from cloudml_lib.science.evaluate import load_end_data, load_run_model
    from cloudml_lib.science.predict import flight_role, flights_to_predict

    rm = load_run_model(folder, data_dir, command="adapt")
    cfg = derive(rm.cfg, {"train.adaptation_labels": [int(n) for n in labels]})
    name = flight or cfg.data.test_flights[0]
    role = flight_role(name, rm.ckpt, cfg)
    if not (role.startswith("not one of") or "nothing was trained" in role):
        raise CloudMLError(
            f"flight {name} is {role}: adaptation is scored on a flight the run never trained or chose on. "
            f"Choose one of its test flights ({', '.join(cfg.data.test_flights)}) or a new flight."
        )
    scalers = Scalers.from_dict(rm.ckpt[Key.SCALERS])
    data = load_end_data(cfg, scalers, rm.ckpt.get(Key.PROVENANCE), rm.ckpt.get(Key.SPLIT))
    cache = load_flight_cache(flights_to_predict(cfg, [name])[name], cfg.data)
    if scalers.atmosphere:
        cache = predictors.attach([cache], cfg.data, scalers.atmosphere)[0]
    flight_set = CloudDataset(
        [cache], scalers, sun_azimuth=cfg.data.sun_azimuth, cloud=False, flags=flag_range(cfg)
    )
    weights = weights_sha256(
        rm.ckpt[Key.MODEL]
    )  # intervals of other weights are none of these (predict's rule)
    calibration = intervals.of_weights(intervals.load(folder.path), weights, folder.best)
    record, _ = flight_curve(rm.model, cfg, flight_set, data.frames, calibration)
    record.update(flight=name, role=role)
    record["words"] = curve_words(name, record)
    return record


def curve_words(name: str, record: dict) -> list[str]:
    """The curve in sentences: the scored part and its gap, then per N the network against the best adapted
    baseline, and the intervals' coverage."""
    lines = [f"{name}: {n} left out: {why}." for n, why in record.get("left_out", {}).items()]
    if not record.get("curve"):
        return lines or [f"{name}: no adaptation curve (too few labels)."]
    lines.insert(
        0,
        f"{name}: scored on its {record['scored_labels']} labels from frame {record['scored_from_frame']} "
        f"on, after the largest adaptation block and a gap of {record['gap_frames']} frames "
        f"({record['gap_from']}).",
    )
    for point in record["curve"]:
        net = point["network"].get("mae_km")
        best, versus = point.get("best_baseline"), point.get("against_best")
        base = (point["baselines"].get(best) or {}).get("mae_km") if best else None
        text = f"  N = {point['n']}: network MAE {_km(net)}"
        if best:
            text += f", best baseline ({best}) {_km(base)}"
            if versus:
                low, high = versus["interval_km"]
                text += f": {versus['call']} (difference {low:+.3f} to {high:+.3f} km)"
        iv = point.get("intervals")
        if iv and iv.get("coverage") is not None:
            text += (
                f"; intervals cover {iv['coverage']:.0%} for a {iv['target']:.0%} target (calibrated on "
                f"{iv['calibrated_on']} errors)"
            )
        elif not iv:
            text += "; no interval (the run has no calibration, and too few labels to make one)"
        lines.append(text + ".")
    return lines


def _km(value) -> str:
    return "n/a" if value is None or not np.isfinite(value) else f"{value:.3f} km"
