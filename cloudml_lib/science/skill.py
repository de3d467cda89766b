"""The numbers of a run's skill on its test flights, per flight first, with their spread.

Each test flight (data.test_flights: nothing was chosen on it) gets the model's and the training-mean
baseline's R2, MAE, RMSE, bias, std(pred)/std(true) and n, a bootstrap interval of its MAE that resamples
whole time blocks (core/metrics.mae_interval), and the share of its labels that lie outside the heights the
model was fitted on; then the pooled row over all test flights, named pooled wherever it is shown (a pooled R2
counts the differences between flights as skill). The intervals' coverage is measured only on flights the
calibration did not see: a flight it saw shows its width and says so, never a coverage (report.py words all of
it).
"""

from __future__ import annotations

import numpy as np

from cloudml_lib.core.network.metrics import mae_difference, mae_interval, regression_metrics
from cloudml_lib.science import intervals

OUT_OF_RANGE_SHARE = (
    0.1  # a test flight with more of its labels outside the training labels than this is named
)


def height_scores(true_km, pred_km, flights, frames, train_mean_km: float) -> dict:
    """The model's and the baseline's metrics per flight and pooled, and each flight's MAE interval."""
    true_km, pred_km = np.asarray(true_km, np.float64), np.asarray(pred_km, np.float64)
    flights = np.asarray(flights)
    baseline = np.full_like(true_km, float(train_mean_km))
    out = {
        "overall": regression_metrics(true_km, pred_km),
        "baseline": regression_metrics(true_km, baseline),
        "per_flight": {},
        "baseline_per_flight": {},
        "mae_interval_km": {},
    }
    for name in dict.fromkeys(flights.tolist()):
        m = flights == name
        out["per_flight"][str(name)] = regression_metrics(true_km[m], pred_km[m])
        out["baseline_per_flight"][str(name)] = regression_metrics(true_km[m], baseline[m])
        out["mae_interval_km"][str(name)] = mae_interval(true_km[m], pred_km[m], np.asarray(frames)[m])
    return out


def against_best(best: dict, true_km, pred_km, flights, frames, predicted: dict) -> dict:
    """Per test flight, the network against its best baseline (`best`: compare_baselines' per-flight best)
    on the same heights: MAE(network) - MAE(baseline) with its 95% interval over time blocks, both models'
    errors resampled together, and the call: better or worse only where the interval excludes 0, else
    level."""
    true_km, pred_km, flights, frames = (np.asarray(a) for a in (true_km, pred_km, flights, frames))
    out = {}
    for name, b in (best or {}).items():
        if not isinstance(b, dict) or b.get("name") not in predicted:
            continue
        m = flights == name
        diff = mae_difference(true_km[m], pred_km[m], np.asarray(predicted[b["name"]])[m], frames[m])
        if diff is None:
            continue
        low, high = diff["interval_km"]
        out[str(name)] = diff | {
            "baseline": b["name"],
            "call": "better" if high < 0 else "worse" if low > 0 else "level",
        }
    return out


TOLERANCES_KM = (0.1, 0.25)  # the shares of heights within these of the label, as papers report them


def lag1(values: np.ndarray) -> float | None:
    """The lag-1 autocorrelation of a series in time order (None with fewer than 3 values or no spread)."""
    x = np.asarray(values, np.float64)
    if x.size < 3 or not np.ptp(x) > 0:
        return None
    a, b = x[:-1] - x.mean(), x[1:] - x.mean()
    return float((a * b).sum() / ((x - x.mean()) ** 2).sum())


def as_papers_report(true_km, pred_km, flights, frames, tolerances_km=TOLERANCES_KM) -> dict:
    """Per test flight, what cloud-base papers quote beside R2 and MAE: the median absolute error, the share
    of heights within each of `tolerances_km` (train.tolerances_km; TOLERANCES_KM by default), the lag-1
    autocorrelation of the labels and of the residuals
    (in time order) and the effective sample size of the residuals, n (1 - r) / (1 + r) for their lag-1
    autocorrelation r (AR(1); n where r <= 0); then the mean over the flights, with how many stand behind
    it."""
    true_km, pred_km, flights, frames = (np.asarray(a) for a in (true_km, pred_km, flights, frames))
    per = {}
    for name in dict.fromkeys(flights.tolist()):
        m = flights == name
        order = np.argsort(frames[m], kind="stable")
        t, err = true_km[m][order].astype(np.float64), (pred_km[m] - true_km[m])[order].astype(np.float64)
        r = lag1(err)
        per[str(name)] = {
            "median_ae_km": float(np.median(np.abs(err))),
            **{f"within_{tol:g}_km": float((np.abs(err) <= tol).mean()) for tol in tolerances_km},
            "lag1_labels": lag1(t),
            "lag1_residuals": r,
            "n": int(err.size),
            "effective_n": float(err.size * (1 - r) / (1 + r))
            if r is not None and r > 0
            else float(err.size),
        }
    keys = ["median_ae_km", *(f"within_{tol:g}_km" for tol in tolerances_km)]
    mean = {k: float(np.mean([v[k] for v in per.values()])) for k in keys} if per else {}
    return {
        "tolerances_km": [float(t) for t in tolerances_km],
        "per_flight": per,
        "mean_over_flights": mean,
        "flights": len(per),
    }


def own_mean_mae(true_km, flights) -> dict:
    """Per flight, the MAE of its own mean height: a model no better than that has no skill there (it may
    still beat the training mean, which another flight's atmosphere set)."""
    true_km, flights = np.asarray(true_km, np.float64), np.asarray(flights)
    return {
        str(n): float(np.abs(true_km[flights == n] - true_km[flights == n].mean()).mean())
        for n in dict.fromkeys(flights.tolist())
    }


def by_height(true_km, pred_km, flights, label_range: list[float] | None, baseline: tuple | None) -> dict:
    """The error by height range, per test flight: thirds of the heights trained on (`label_range`), and below
    or above them where a flight has labels there; in each, n, the network's MAE and bias (predicted - true)
    and, with `baseline` (its name, its heights for the same samples), that baseline's MAE. {} without a
    range."""
    if not label_range or not label_range[1] > label_range[0]:
        return {}
    low, high = float(label_range[0]), float(label_range[1])
    edges = [low, low + (high - low) / 3, low + 2 * (high - low) / 3, high]
    true_km, pred_km, flights = (np.asarray(a) for a in (true_km, pred_km, flights))
    base_km = None if baseline is None else np.asarray(baseline[1], np.float64)
    bins = [(-np.inf, low, f"below {low:.2f}")]
    bins += [(edges[i], edges[i + 1], f"{edges[i]:.2f}-{edges[i + 1]:.2f}") for i in range(3)]
    bins += [(high, np.inf, f"above {high:.2f}")]
    out = {}
    for name in dict.fromkeys(flights.tolist()):
        rows = []
        for k, (a, b, words) in enumerate(bins):
            # the top third includes the highest label trained on; nothing else lies in two bins
            inside = (true_km >= a) & ((true_km <= b) if k == 3 else (true_km < b))
            m = inside & (flights == name)
            if not m.any() and k in (0, 4):
                continue
            err = pred_km[m] - true_km[m]
            row = {
                "range": words,
                "n": int(m.sum()),
                "mae_km": float(np.abs(err).mean()) if m.any() else None,
                "bias_km": float(err.mean()) if m.any() else None,
            }
            if base_km is not None:
                row["baseline_mae_km"] = float(np.abs(base_km[m] - true_km[m]).mean()) if m.any() else None
            rows.append(row)
        out[str(name)] = rows
    return {
        "edges_km": [round(e, 3) for e in edges],
        "baseline": None if baseline is None else baseline[0],
        "per_flight": out,
    }


def outside_labels(true_km, flights, label_range: list[float] | None) -> dict:
    """Per flight: how many of its labels lie outside `label_range` (the heights trained on), and their
    span; {} without a range."""
    if not label_range:
        return {}
    low, high = float(label_range[0]), float(label_range[1])
    true_km, flights = np.asarray(true_km, np.float64), np.asarray(flights)
    out = {}
    for name in dict.fromkeys(flights.tolist()):
        t = true_km[flights == name]
        if t.size:
            outside = int(((t < low) | (t > high)).sum())
            out[str(name)] = {
                "outside": outside,
                "n": int(t.size),
                "share": outside / t.size,
                "low_km": float(t.min()),
                "high_km": float(t.max()),
            }
    return out


def interval_scores(true_km, pred_km, flights, calibration: dict, calibrated_on: list[str]) -> dict:
    """The intervals' mean width on every flight, and their coverage (share of true heights inside) where
    the calibration did not see the flight (`calibrated_on`: the flights its heights came from); the pooled
    row over those flights alone."""
    true_km, pred_km, flights = (np.asarray(a) for a in (true_km, pred_km, flights))
    lower, upper = intervals.bounds(pred_km.astype(np.float64), calibration)
    seen = set(calibrated_on)
    per_flight = {}
    for name in dict.fromkeys(flights.tolist()):
        m = flights == name
        s = intervals.scores(true_km[m], lower[m], upper[m])
        if name in seen:  # coverage on the calibration's own heights holds by construction: never reported
            s = {**s, "coverage": None, "calibrated_here": True}
        per_flight[str(name)] = s
    unseen = ~np.isin(flights, list(seen))
    return {
        "method": calibration["method"],
        "coverage_target": calibration["coverage"],
        "calibration": calibration["source"],
        "mode": calibration.get("mode", "pooled"),
        "calibrated_on": sorted(seen),
        "overall": intervals.scores(true_km[unseen], lower[unseen], upper[unseen]),
        "per_flight": per_flight,
    }


def validation_scores(true_km, pred_km, groups) -> dict:
    """The best model on the validation data that chose it: pooled and per group (flight or time block)."""
    true_km, pred_km, groups = np.asarray(true_km), np.asarray(pred_km), np.asarray(groups)
    return {
        "pooled": regression_metrics(true_km, pred_km),
        "per_flight": {
            str(g): regression_metrics(true_km[groups == g], pred_km[groups == g])
            for g in dict.fromkeys(groups.tolist())
        },
    }
