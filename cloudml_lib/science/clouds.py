"""Cloud / no-cloud after training: the two baselines the model's cloud output must beat, fitted on the
training flights only, the cloud section of a report, and the probe (a logistic regression on the trained
network's features) that the end of a run fits.

- `majority`: always the training flights' majority class;
- `bt_threshold`: cloud where the frame's 10th-percentile brightness (`frame_p10`, the raw file
  units, monotonic in brightness temperature) lies below a threshold, the one that classifies
  the training flights best.
Truth: the CPL layer count of the profile matched to a frame (`Number_Layers == 0` is clear sky); the
metrics themselves are core/metrics.py's."""

from __future__ import annotations

import numpy as np

from cloudml_lib.core.metrics import cloud_metrics

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


def baseline_scores(name: str, train: dict, p10: np.ndarray) -> tuple[np.ndarray, float]:
    """(score per frame, threshold on it) of a baseline fitted on `train` ({"flag", "p10"})."""
    n = len(p10)
    if name == "majority":
        share = float(np.mean(train["flag"])) if len(train["flag"]) else 0.0
        return np.full(n, share), 0.5  # the majority class everywhere, AUC 0.5
    threshold = fit_threshold(train["p10"], train["flag"])
    return -np.asarray(p10, np.float64), -threshold  # colder (lower) means cloud


def cloud_report(
    flags: np.ndarray,
    prob: np.ndarray | None,
    flights: np.ndarray,
    p10: np.ndarray,
    train: dict,
    threshold: float,
) -> dict:
    """Overall and per-flight metrics of the model (when it has a cloud output) and of both baselines."""
    methods = {name: baseline_scores(name, train, p10) for name in BASELINES}
    if prob is not None:
        methods = {"model": (prob, threshold), **methods}
    out = {
        "threshold": threshold,
        "train_cloud_share": float(np.mean(train["flag"])) if len(train["flag"]) else None,
        "bt_threshold": fit_threshold(train["p10"], train["flag"]),
    }
    for name, (score, thr) in methods.items():
        out[name] = {
            "overall": cloud_metrics(flags, score, thr),
            "per_flight": {
                str(f): cloud_metrics(flags[flights == f], score[flights == f], thr)
                for f in dict.fromkeys(flights)
            },
        }
    return out


def format_cloud(report: dict) -> str:
    """A plain-text table: accuracy, F1 and ROC-AUC per method, overall and per flight."""
    num = lambda v: f"{v:10.3f}" if v is not None else f"{'-':>10s}"  # noqa: E731
    rows = []
    for method in [m for m in ("model", *BASELINES) if m in report]:
        rows.append((f"{method}: all", report[method]["overall"]))
        rows += [(f"{method}: flight {k}", v) for k, v in report[method]["per_flight"].items()]
    width = max(28, *(len(r[0]) for r in rows))
    lines = [
        f"{'cloud / no-cloud':{width}s}" + "".join(f"  {h:>10s}" for h in ("accuracy", "F1", "ROC-AUC", "n"))
    ]
    for name, m in rows:
        lines.append(
            f"{name:{width}s}  {num(m['accuracy'])}  {num(m['f1'])}  {num(m['roc_auc'])}  {m['n']:10d}"
        )
    return "\n".join(lines)


def fit_probe(features: np.ndarray, flag: np.ndarray) -> tuple[np.ndarray, float] | None:
    """model.cloud_head probe: a logistic regression (scikit-learn, L2, C=1) of the cloud flag on the
    features, standardised for the fit; returned as weights and bias on the raw features. None when the
    frames do not hold both classes (nothing to separate) or no frame has finite features."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression

    features, flag = np.asarray(features, np.float64), np.asarray(flag, np.int64)
    ok = np.isfinite(features).all(axis=1)
    features, flag = features[ok], flag[ok]
    if not 0 < flag.sum() < flag.size:
        return None
    mean, std = features.mean(axis=0), features.std(axis=0)
    std[std < 1e-12] = 1.0  # a constant feature: weight 0 either way
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)  # the weights after max_iter are still usable
        clf = LogisticRegression(C=1.0, max_iter=5000).fit((features - mean) / std, flag)
    weight = clf.coef_[0] / std
    return weight, float(clf.intercept_[0] - weight @ mean)
