"""The metrics of a model's answers, the same during training (each epoch's score) and after it (the
test report): heights in km and the cloud / no-cloud flag.

Every height metric set holds r2, mae_km, rmse_km, bias_km (mean of predicted - true), std_ratio
(std(pred) / std(true)) and n. Cloud / no-cloud metrics: accuracy, F1 of the cloud class, ROC-AUC
(scikit-learn), n and the share of cloudy frames. `Scored` holds a model's answers for the samples of a
dataset, in km.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cloudml_lib.base.config import BASE_IN_RANGE  # the cloud classes are the config's (cpl names them too)


class HeightScale(Protocol):
    """How a standardised height becomes km (data.dataset.Scalers has it): metrics read no data type."""

    cbh_mean: float
    cbh_std: float


BOUND_TOLERANCE_KM = 1e-3  # a height this far past a bound is float rounding, not outside it


def outside_bounds(height_km: np.ndarray, low: float, high) -> tuple[np.ndarray, np.ndarray]:
    """(below, above): where a height lies below `low` or above `high` (a number, or one per height), by
    more than float rounding (BOUND_TOLERANCE_KM). NaN is neither."""
    h = np.asarray(height_km, np.float64)
    with np.errstate(invalid="ignore"):
        return h < low - BOUND_TOLERANCE_KM, h > np.asarray(high, np.float64) + BOUND_TOLERANCE_KM


def bounds_count(pred_km: np.ndarray, bounds: tuple[float, float]) -> dict:
    """How many of the predictions lie outside the heights a cloud base can have (config.height_bounds_km);
    the metrics keep them as predicted (predict masks them)."""
    below, above = outside_bounds(pred_km, *bounds)
    return {
        "low_km": float(bounds[0]),
        "high_km": float(bounds[1]),
        "below": int(below.sum()),
        "above": int(above.sum()),
        "n": int(np.isfinite(np.asarray(pred_km, np.float64)).sum()),
    }


def regression_metrics(true_km: np.ndarray, pred_km: np.ndarray) -> dict:
    true_km, pred_km = np.asarray(true_km, np.float64), np.asarray(pred_km, np.float64)
    n = int(true_km.size)
    if n == 0:
        return {
            "r2": float("nan"),
            "mae_km": float("nan"),
            "rmse_km": float("nan"),
            "bias_km": float("nan"),
            "std_ratio": float("nan"),
            "n": 0,
        }
    err = pred_km - true_km
    varies = bool(np.ptp(true_km) > 0)  # labels that do not vary have no R2 (not a rounding residue's)
    ss_tot = float(((true_km - true_km.mean()) ** 2).sum())
    std_true = float(true_km.std()) if varies else 0.0
    return {
        "r2": 1.0 - float((err**2).sum()) / ss_tot if varies and ss_tot > 0 else float("nan"),
        "mae_km": float(np.abs(err).mean()),
        "rmse_km": float(np.sqrt((err**2).mean())),
        "bias_km": float(err.mean()),
        "std_ratio": float(pred_km.std()) / std_true if std_true > 0 else float("nan"),
        "n": n,
    }


@dataclass
class Scored:
    """A model's answers for the samples of a dataset, in order."""

    height_km: np.ndarray  # (N,) predicted height for every sample (with a height label or not)
    cloud_prob: np.ndarray | None  # (N,) probability of the cloud flag; None: the model has no cloud output
    class_prob: np.ndarray | None = None  # (N, K) probability of each cloud class; None: no classes

    @classmethod
    def from_outputs(cls, out: dict, scalers: HeightScale) -> Scored:
        """From the model's outputs by name (predict)."""
        logit = out["cloud_logit"]
        prob = None if logit is None else 1.0 / (1.0 + np.exp(-np.clip(logit, -60, 60)))
        return cls(
            out["height"] * scalers.cbh_std + scalers.cbh_mean, prob, softmax(out.get("cloud_classes"))
        )

    def classes(self, threshold: float) -> np.ndarray | None:
        """The cloud class of each sample (cpl's classes): a cloud base in range where the flag's probability
        reaches `threshold`, else the likeliest other class; 0/1 where the model gives the flag alone. None
        without a cloud output; -1 where the probability is not finite."""
        return cloud_class(self.cloud_prob, self.class_prob, threshold)


def softmax(logits: np.ndarray | None) -> np.ndarray | None:
    if logits is None:
        return None
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def cloud_class(
    prob: np.ndarray | None, class_prob: np.ndarray | None, threshold: float
) -> np.ndarray | None:
    """Scored.classes for arrays: the flag's probability (N,) and the class probabilities (N, K) or None."""
    if prob is None:
        return None
    prob = np.asarray(prob, np.float64)
    ok = np.isfinite(prob)
    out = np.full(prob.shape, -1, np.int64)
    flagged = ok & (prob >= threshold)
    if class_prob is None:
        out[ok] = flagged[ok].astype(np.int64)
        return out
    others = np.asarray(class_prob, np.float64).copy()
    others[:, BASE_IN_RANGE] = -np.inf
    out[ok] = np.argmax(others[ok], axis=1)
    out[flagged] = BASE_IN_RANGE
    return out


def cloud_metrics(flag: np.ndarray, score: np.ndarray, threshold: float = 0.5) -> dict:
    """`flag` true 0/1, `score` the cloud probability (or any score increasing with cloud) and the threshold
    that turns it into a flag."""
    from sklearn.metrics import accuracy_score, f1_score, roc_auc_score

    flag, score = np.asarray(flag, np.int64), np.asarray(score, np.float64)
    ok = np.isfinite(score)
    flag, score = flag[ok], score[ok]
    if flag.size == 0:
        return {"accuracy": None, "f1": None, "roc_auc": None, "n": 0, "cloud_share": None}
    guess = (score >= threshold).astype(np.int64)
    return {
        "accuracy": float(accuracy_score(flag, guess)),
        "f1": float(f1_score(flag, guess, zero_division=0.0)),
        "roc_auc": float(roc_auc_score(flag, score)) if 0 < flag.sum() < flag.size else None,
        "n": int(flag.size),
        "cloud_share": float(flag.mean()),
    }


BURST_GAP_FRAMES = 60  # labels more than this many frames (about a minute) apart start a new time block
MIN_BLOCKS = 10  # fewer bursts than this: the samples are cut into this many contiguous blocks instead
BOOTSTRAP_DRAWS = 2000


def time_blocks(frame_index: np.ndarray) -> list[np.ndarray]:
    """The samples (positions into `frame_index`) in contiguous time blocks: the bursts in which lidar labels
    arrive (a gap over BURST_GAP_FRAMES starts a new one), or, with fewer than MIN_BLOCKS bursts, MIN_BLOCKS
    runs of consecutive samples. Errors of neighbouring frames are alike: resampling single frames would
    pretend to more independent samples than a flight holds."""
    order = np.argsort(np.asarray(frame_index), kind="stable")
    frames = np.asarray(frame_index)[order]
    bursts = np.split(order, np.flatnonzero(np.diff(frames) > BURST_GAP_FRAMES) + 1)
    if len(bursts) >= MIN_BLOCKS:
        return bursts
    return [b for b in np.array_split(order, min(MIN_BLOCKS, order.size)) if b.size]


def paired_difference(d: np.ndarray, frame_index: np.ndarray, level: float = 0.95) -> dict | None:
    """The mean of per-sample differences `d` between two models on the same samples, and a `level`
    bootstrap interval of it that resamples whole time blocks (time_blocks; both models' samples together);
    None with fewer than 5 samples."""
    d = np.asarray(d, np.float64)
    if d.size < 5:
        return None
    blocks = time_blocks(frame_index)
    sums, sizes = np.array([d[b].sum() for b in blocks]), np.array([b.size for b in blocks])
    draw = np.random.default_rng(0).integers(0, len(blocks), size=(BOOTSTRAP_DRAWS, len(blocks)))
    means = sums[draw].sum(axis=1) / sizes[draw].sum(axis=1)
    tail = 100 * (1 - level) / 2
    low, high = float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))
    return {"difference": float(d.mean()), "interval": [low, high], "blocks": len(blocks)}


def mae_difference(
    true_km: np.ndarray, pred_a: np.ndarray, pred_b: np.ndarray, frame_index: np.ndarray, level: float = 0.95
) -> dict | None:
    """MAE(a) - MAE(b) (km) on the same samples with its paired interval over time blocks
    (paired_difference); None with fewer than 5 samples."""
    t = np.asarray(true_km, np.float64)
    d = np.abs(np.asarray(pred_a, np.float64) - t) - np.abs(np.asarray(pred_b, np.float64) - t)
    got = paired_difference(d, frame_index, level)
    if got is None:
        return None
    return {"mae_difference_km": got["difference"], "interval_km": got["interval"], "blocks": got["blocks"]}


def mae_interval(
    true_km: np.ndarray, pred_km: np.ndarray, frame_index: np.ndarray, level: float = 0.95, seed: int = 0
) -> list[float] | None:
    """A `level` bootstrap interval of the MAE (km), resampling whole time blocks (time_blocks) with
    replacement; None with fewer than 5 samples. The same numbers for the same input (a fixed seed)."""
    err = np.abs(np.asarray(pred_km, np.float64) - np.asarray(true_km, np.float64))
    if err.size < 5:
        return None
    blocks = time_blocks(frame_index)
    sums = np.array([err[b].sum() for b in blocks])
    sizes = np.array([b.size for b in blocks])
    draw = np.random.default_rng(seed).integers(0, len(blocks), size=(BOOTSTRAP_DRAWS, len(blocks)))
    maes = sums[draw].sum(axis=1) / sizes[draw].sum(axis=1)
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(maes, tail)), float(np.percentile(maes, 100 - tail))]
