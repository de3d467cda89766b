"""Cloud / no-cloud after training: the two baselines the model's cloud output must beat, fitted on the
training flights only, the cloud section of a report, and the probe (a logistic regression on the trained
network's features) that the end of a run fits.

- `majority`: always the training flights' majority class;
- `bt_threshold`: the brightness temperature of the frame's cold pixels (`frame_p10`, the 10th percentile of
  its raw values, in the file's units, monotonic in brightness temperature) against what the training
  flights' frames teach: with data.cloud_flag base_in_range, a window (a cloud base in the label range is
  colder than the sea and warmer than high cloud: cloud where frame_p10 lies inside the window that
  classifies the training frames best); with any_layer, a threshold (cloud below it).
Truth: the cloud flag of the profile matched to a frame (data/cpl.py: a cloud base in the label range, or
any CPL layer); the metrics are core/network/metrics.py's. `bt_flag` is that baseline's flag for frames
of a whole flight (predict --cloud-flag bt_threshold)."""

from __future__ import annotations

import numpy as np

from cloudml_lib.core.network.metrics import cloud_metrics

BASELINES = ("majority", "bt_threshold")


def fit_threshold(p10: np.ndarray, flag: np.ndarray) -> float:
    """The frame_p10 threshold (cloud below it) that classifies the training frames best."""
    p10, flag = np.asarray(p10, np.float64), np.asarray(flag, np.int64)
    ok = np.isfinite(p10)
    p10, flag = p10[ok], flag[ok]
    if p10.size == 0:
        return float("nan")
    order = np.argsort(p10)
    x, y = p10[order], flag[order]
    # threshold between x[k-1] and x[k]: frames 0..k-1 called cloud; correct = clouds among them + clear after
    correct = np.concatenate([[0], np.cumsum(y)]) + (np.sum(1 - y) - np.concatenate([[0], np.cumsum(1 - y)]))
    k = int(np.argmax(correct))
    if k == 0:
        return float(np.nextafter(x[0], -np.inf))  # nothing below: every frame clear
    if k == len(x):
        return float(np.nextafter(x[-1], np.inf))  # every frame cloud
    return float((x[k - 1] + x[k]) / 2)


def fit_window(p10: np.ndarray, flag: np.ndarray) -> tuple[float, float]:
    """The frame_p10 window [low, high] (cloud inside it) that classifies the training frames best: the
    run of sorted values whose cloud-minus-clear count is largest (Kadane's scan over the distinct values);
    an end at the data's edge is open (-inf or inf). (nan, nan) without frames; an empty window (low > high)
    where calling no frame cloud is best."""
    p10, flag = np.asarray(p10, np.float64), np.asarray(flag, np.int64)
    ok = np.isfinite(p10)
    if not ok.any():
        return float("nan"), float("nan")
    values, where = np.unique(p10[ok], return_inverse=True)
    gain = np.bincount(where, weights=2 * flag[ok] - 1, minlength=values.size)  # cloud +1, clear -1
    best, start, run, first = 0.0, 0, 0.0, (0, -1)
    for k, g in enumerate(gain):
        if run <= 0:
            run, start = g, k
        else:
            run += g
        if run > best:
            best, first = run, (start, k)
    lo, hi = first
    if hi < lo:
        return float("inf"), float("-inf")
    low = -np.inf if lo == 0 else float((values[lo - 1] + values[lo]) / 2)
    high = np.inf if hi == values.size - 1 else float((values[hi] + values[hi + 1]) / 2)
    return float(low), float(high)


def window_score(p10: np.ndarray, window: tuple[float, float]) -> np.ndarray:
    """How far inside the window each frame_p10 lies (>= 0 inside, < 0 outside): a score that increases with
    cloud, for the window's accuracy (threshold 0) and ROC-AUC."""
    p10 = np.asarray(p10, np.float64)
    with np.errstate(invalid="ignore"):
        return -np.maximum(window[0] - p10, p10 - window[1])


def baseline_scores(
    name: str, train: dict, p10: np.ndarray, window: bool = False
) -> tuple[np.ndarray, float]:
    """(score per frame, threshold on it) of a baseline fitted on `train` ({"flag", "p10"}); `window`: the
    brightness-temperature baseline is a window (data.cloud_flag base_in_range), else a threshold."""
    n = len(p10)
    if name == "majority":
        share = float(np.mean(train["flag"])) if len(train["flag"]) else 0.0
        return np.full(n, share), 0.5  # the majority class everywhere, AUC 0.5
    if window:
        return window_score(p10, fit_window(train["p10"], train["flag"])), 0.0
    threshold = fit_threshold(train["p10"], train["flag"])
    return -np.asarray(p10, np.float64), -threshold  # colder (lower) means cloud


def fitted_baseline(train: dict, window: bool) -> dict:
    """The brightness-temperature baseline as best.pt keeps it (predict --cloud-flag bt_threshold): its kind,
    its bounds in the file's units (None: open), and the flag it was fitted for."""
    if window:
        low, high = fit_window(train["p10"], train["flag"])
    else:
        low, high = -np.inf, fit_threshold(train["p10"], train["flag"])
    bound = lambda v: float(v) if np.isfinite(v) else None  # noqa: E731
    return {"kind": "window" if window else "threshold", "low": bound(low), "high": bound(high)}


def bt_flag(p10: np.ndarray, baseline: dict) -> np.ndarray:
    """The brightness-temperature baseline's class per frame (fitted_baseline): 1 inside (a cloud, or a cloud
    base in the range for a window), 0 warmer (clear sky, or fog near the sea's temperature), 2 colder than
    a window (cloud above the range: high cloud); -1 where frame_p10 is not finite."""
    p10 = np.asarray(p10, np.float64)
    low = -np.inf if baseline.get("low") is None else baseline["low"]
    high = np.inf if baseline.get("high") is None else baseline["high"]
    out = np.full(p10.shape, -1, np.int64)
    ok = np.isfinite(p10)
    out[ok] = np.where(p10[ok] > high, 0, np.where(p10[ok] < low, 2, 1))
    return out


def cloud_report(
    flags: np.ndarray,
    prob: np.ndarray | None,
    flights: np.ndarray,
    p10: np.ndarray,
    train: dict,
    threshold: float,
    window: bool = False,
    frames: np.ndarray | None = None,
) -> dict:
    """Overall and per-flight metrics of the model (when it has a cloud output) and of both baselines;
    `window`: the brightness-temperature baseline is a window (data.cloud_flag base_in_range); with the
    frames' indices (`frames`), the model's accuracy against each baseline's with its paired interval."""
    methods = {name: baseline_scores(name, train, p10, window) for name in BASELINES}
    if prob is not None:
        methods = {"model": (prob, threshold), **methods}
    fitted = fitted_baseline(train, window)
    out = {
        "threshold": threshold,
        "train_cloud_share": float(np.mean(train["flag"])) if len(train["flag"]) else None,
        "bt_threshold": fit_threshold(train["p10"], train["flag"]),
    }
    if window:
        out["bt_window"] = [fitted["low"], fitted["high"]]
    if prob is not None and frames is not None:
        out["accuracy_against"] = accuracy_against(flags, methods, flights, frames)
    for name, (score, thr) in methods.items():
        out[name] = {
            "overall": cloud_metrics(flags, score, thr),
            "per_flight": {
                str(f): cloud_metrics(flags[flights == f], score[flights == f], thr)
                for f in dict.fromkeys(flights)
            },
        }
    return out


def accuracy_against(flags, methods: dict, flights, frames) -> dict:
    """The model's accuracy less each baseline's on the same frames, with a 95% interval over time blocks
    (each flight's own: both flags resampled together), and the call: better or worse only where the interval
    excludes 0, else level."""
    from cloudml_lib.core.network.metrics import paired_difference

    flags, flights = np.asarray(flags, np.int64), np.asarray(flights)
    flight_id = np.unique(flights, return_inverse=True)[1]
    blocks = (
        np.asarray(frames, np.int64) + flight_id.astype(np.int64) * 10**9
    )  # never one block across flights

    def right(name):
        score, thr = methods[name]
        score = np.asarray(score, np.float64)
        return np.where(np.isfinite(score), ((score >= thr).astype(np.int64) == flags), np.nan)

    model, out = right("model"), {}
    for name in BASELINES:
        d = model - right(name)
        ok = np.isfinite(d)
        got = paired_difference(d[ok], blocks[ok])
        if got is not None:
            low, high = got["interval"]
            out[name] = got | {"call": "better" if low > 0 else "worse" if high < 0 else "level"}
    return out


PROBE_ABSENT_BIAS = -100.0  # a class no training frame holds: its probability is 0


def fit_probe(
    features: np.ndarray, labels: np.ndarray, classes: int = 1
) -> tuple[np.ndarray, np.ndarray] | None:
    """model.cloud_head probe: a logistic regression (scikit-learn, L2, C=1) of the cloud labels on the
    features, standardised for the fit; returned as weights (K, F) and biases (K,) on the raw features.
    `classes` 1: `labels` are 0/1 and the probe gives one logit; more: `labels` are class numbers 0..K-1 and
    the probe gives one logit per class (multinomial; a class no frame holds gets no weight and a bias that
    makes it impossible). None when the frames do not hold two classes (nothing to separate) or no frame
    has finite features."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    features, labels = np.asarray(features, np.float64), np.asarray(labels, np.int64)
    ok = np.isfinite(features).all(axis=1)
    features, labels = features[ok], labels[ok]
    present = np.unique(labels)
    if present.size < 2:
        return None
    mean, std = features.mean(axis=0), features.std(axis=0)
    std[std < 1e-12] = 1.0  # a constant feature: weight 0 either way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the weights after max_iter are still usable
        clf = LogisticRegression(C=1.0, max_iter=5000).fit((features - mean) / std, labels)
    coef = clf.coef_ / std
    intercept = np.array([clf.intercept_[k] - coef[k] @ mean for k in range(len(coef))])
    if classes == 1:
        return coef[:1], intercept[:1]
    weight = np.zeros((classes, features.shape[1]))
    bias = np.full(classes, PROBE_ABSENT_BIAS)
    if present.size == 2:  # one logit: of classes_[1] against classes_[0]
        weight[present[1]], bias[present[1]], bias[present[0]] = coef[0], intercept[0], 0.0
    else:
        weight[present], bias[present] = coef, intercept
    return weight, bias
