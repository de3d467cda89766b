"""Prediction intervals for the cloud base height that hold on a flight never seen.

Split conformal prediction with MAPIE (`SplitConformalRegressor`, prefit): the model is already
trained, so MAPIE only needs its predictions and the true heights of a calibration set. What makes
the intervals honest is the calibration set: heights the model never trained on, from *other
flights* than the one it is used on. `crossval` provides exactly that (each flight predicted by the
fold that tested on it): for each test flight the intervals are calibrated on the other flights'
residuals and their coverage is measured on that flight, per method; the method whose coverage
falls least short of the target (then the narrowest) is chosen for each flight on the other flights
alone (nested, so the coverage reported was not what chose), and on all flights for predict. A single
run calibrates on its validation data (drawn from its training flights: data/splits.py), never on a test
flight, so the coverage its report measures on the test flights is a coverage on flights the calibration
never saw. With
`train.interval_calibration: per_flight` each validation flight (or time block) with enough heights is
calibrated on its own and the widest bounds are taken (a Mondrian calibration by flight, made conservative:
every one of those flights reaches the target), because flights differ: the users' pooled intervals covered
27-34 % of some flights' heights for a 90 % target.

Methods (MAPIE conformity scores): `conformal_absolute`, a constant width |y - y_hat|;
`conformal_gamma`, a width proportional to the predicted height |y - y_hat| / y_hat.

`intervals.json` in a run folder holds the method, the target coverage, the calibration pairs (predicted and
true km), the group (flight) of each pair and the flights they came from, from which `predict` recomputes the
bounds with MAPIE.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from cloudml_lib.base.errors import CloudMLError, install_command
from cloudml_lib.base.runfiles import INTERVAL_METHODS, RunFiles
from cloudml_lib.core.run.folder import RunFolder

log = logging.getLogger(__name__)

METHODS = dict(zip(INTERVAL_METHODS, ("absolute", "gamma"), strict=True))
MIN_CALIBRATION = 20  # fewer calibration heights: no interval (a 90% quantile of 10 numbers means little)
FAR_BELOW = 0.15  # coverage this far under the target on a flight: a plain warning
FILE = RunFolder.INTERVALS


def _mapie(pred_km: np.ndarray, true_km: np.ndarray, method: str, coverage: float):
    try:
        from mapie.regression import SplitConformalRegressor
        from sklearn.base import BaseEstimator, RegressorMixin
    except ImportError:
        raise CloudMLError(
            f"prediction intervals need MAPIE, which is not installed (it comes with CloudML): "
            f"{install_command('mapie>=1.0,<2')}, then run the same command again"
        ) from None

    class GivenPredictions(RegressorMixin, BaseEstimator):
        """The trained network's predictions, passed in as the only feature: MAPIE's prefit estimator."""

        def fit(self, X, y=None):
            self.fitted_ = True
            return self

        def predict(self, X):
            return np.asarray(X, np.float64)[:, 0]

    conformal = SplitConformalRegressor(
        GivenPredictions().fit(pred_km[:, None]),
        confidence_level=coverage,
        conformity_score=METHODS[method],
        prefit=True,
    )
    return conformal.conformalize(pred_km[:, None], true_km)


def _usable(pred: np.ndarray, true: np.ndarray) -> np.ndarray:
    return np.isfinite(pred) & np.isfinite(true) & (pred > 0) & (true > 0)  # gamma needs positive heights


def bounds(pred_km: np.ndarray, calibration: dict) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) km for each prediction from a calibration (calibrate): pooled, or per_flight (the
    widest of the groups' own bounds); NaN where the prediction is."""
    pred = np.asarray(pred_km, np.float64)
    lower, upper = np.full(pred.shape, np.nan), np.full(pred.shape, np.nan)
    ok = np.isfinite(pred) & (pred > 0)
    if ok.any():
        cal_pred, cal_true = np.asarray(calibration["pred_km"]), np.asarray(calibration["true_km"])
        low, high = np.full(int(ok.sum()), np.inf), np.full(int(ok.sum()), -np.inf)
        for part in calibration_groups(calibration):
            conformal = _mapie(cal_pred[part], cal_true[part], calibration["method"], calibration["coverage"])
            _, iv = conformal.predict_interval(pred[ok][:, None], allow_infinite_bounds=False)
            low, high = np.minimum(low, iv[:, 0, 0]), np.maximum(high, iv[:, 1, 0])
        lower[ok], upper[ok] = low, high
    return lower, upper


def calibration_groups(calibration: dict) -> list[np.ndarray]:
    """The pairs each bound is computed from: one group of all pairs (pooled), or per_flight each group with
    MIN_CALIBRATION pairs or more, the smaller ones together where they reach it."""
    n = len(calibration["pred_km"])
    groups = calibration.get("group")
    if calibration.get("mode") != "per_flight" or not groups:
        return [np.arange(n)]
    groups = np.asarray(groups)
    names = list(dict.fromkeys(groups.tolist()))
    big = [np.flatnonzero(groups == g) for g in names if (groups == g).sum() >= MIN_CALIBRATION]
    rest = np.flatnonzero(~np.isin(groups, [g for g in names if (groups == g).sum() >= MIN_CALIBRATION]))
    parts = big + ([rest] if rest.size >= MIN_CALIBRATION else [])
    return parts or [np.arange(n)]


def calibrate(
    pred_km, true_km, method: str, coverage: float, source: str, groups=None, mode: str = "pooled"
) -> dict | None:
    """A calibration from (predicted, true) heights of data the model was not fitted on; None (with a
    warning) when too few. `groups`: each pair's flight (or time block), recorded with the flights they came
    from; `mode` per_flight calibrates each group of enough pairs on its own (calibration_groups)."""
    pred, true = np.asarray(pred_km, np.float64), np.asarray(true_km, np.float64)
    keep = _usable(pred, true)
    pred, true = pred[keep], true[keep]
    if pred.size < MIN_CALIBRATION:
        log.warning(
            "no prediction intervals: %d heights to calibrate them on (%s), fewer than %d",
            pred.size,
            source,
            MIN_CALIBRATION,
        )
        return None
    out = {
        "method": method,
        "coverage": float(coverage),
        "n": int(pred.size),
        "source": source,
        "pred_km": [round(float(x), 5) for x in pred],
        "true_km": [round(float(x), 5) for x in true],
    }
    if groups is not None:
        kept = np.asarray(groups)[keep]
        out.update(mode=mode, group=[str(g) for g in kept], flights=list(dict.fromkeys(str(g) for g in kept)))
        used = len(calibration_groups(out))
        if mode == "per_flight":
            out["source"] += f"; per flight: the widest of {used} calibration{'s' * (used != 1)}"
    return out


def scores(true_km, lower, upper) -> dict:
    """Coverage (share of true heights inside) and mean width (km) of intervals."""
    true = np.asarray(true_km, np.float64)
    ok = np.isfinite(true) & np.isfinite(lower) & np.isfinite(upper)
    if not ok.any():
        return {"coverage": None, "mean_width_km": None, "n": 0}
    inside = (true[ok] >= lower[ok]) & (true[ok] <= upper[ok])
    return {
        "coverage": float(inside.mean()),
        "mean_width_km": float((upper[ok] - lower[ok]).mean()),
        "n": int(ok.sum()),
    }


def _coverage_on(by_flight: dict, name: str, calibrate_on: list[str], method: str, coverage: float):
    """Scores on flight `name` of `method`'s intervals calibrated on the flights `calibrate_on`; None where
    they hold too few heights (quietly: the callers say what could not be measured)."""
    pairs = [by_flight[o] for o in calibrate_on]
    if not pairs:
        return None
    pred, true = np.concatenate([p for p, _ in pairs]), np.concatenate([t for _, t in pairs])
    if _usable(pred, true).sum() < MIN_CALIBRATION:
        return None
    cal = calibrate(pred, true, method, coverage, f"the other {len(pairs)} flights")
    return scores(by_flight[name][1], *bounds(by_flight[name][0], cal))


def _best(per_method: dict[str, list[dict]], coverage: float) -> str | None:
    """The method whose coverages fall least short of the target on average (then the narrowest)."""
    mean = {}
    for method, got in per_method.items():
        got = [p for p in got if p and p["coverage"] is not None]
        if got:
            shortfall = np.mean([max(0.0, coverage - p["coverage"]) for p in got])
            mean[method] = (round(float(shortfall), 3), float(np.mean([p["mean_width_km"] for p in got])))
    return min(mean, key=mean.get) if mean else None


def leave_one_flight_out(by_flight: dict[str, tuple[np.ndarray, np.ndarray]], coverage: float) -> dict:
    """Per method and test flight: intervals calibrated on the other flights' (pred, true) heights, scored
    on this one. The method is chosen twice. For the estimate ("nested"), each flight's method is chosen
    on the other flights alone (each of them scored with a calibration on the rest), so the coverage
    reported on a flight was not what chose its method; with fewer than three flights nothing is left to
    choose on and the first method is taken. For the calibrations written for predict ("chosen"), on
    every flight. Returns {"methods": {method: {"per_flight": {...}, "mean_coverage", "mean_shortfall",
    "mean_width_km"}}, "chosen": method, "nested": {"per_flight": {flight: {"method", "coverage",
    "mean_width_km", "n"}}, "mean_coverage", "mean_width_km"}, "verdicts": [...]}."""
    names = list(by_flight)
    out = {}
    for method in METHODS:
        per = {}
        for name in names:
            got = _coverage_on(by_flight, name, [o for o in names if o != name], method, coverage)
            if got is not None:
                per[name] = got
        got = [p for p in per.values() if p["coverage"] is not None]
        out[method] = {
            "per_flight": per,
            "mean_coverage": float(np.mean([p["coverage"] for p in got])) if got else None,
            "mean_shortfall": float(np.mean([max(0.0, coverage - p["coverage"]) for p in got]))
            if got
            else None,
            "mean_width_km": float(np.mean([p["mean_width_km"] for p in got])) if got else None,
        }
    chosen = _best({m: list(out[m]["per_flight"].values()) for m in METHODS}, coverage)
    nested = {}
    for name in names:
        others = [o for o in names if o != name]
        inner = {
            m: [_coverage_on(by_flight, b, [o for o in others if o != b], m, coverage) for b in others]
            for m in METHODS
        }
        method = _best(inner, coverage) or next(iter(METHODS))
        got = out[method]["per_flight"].get(name)
        if got is not None and got["coverage"] is not None:
            nested[name] = {"method": method, **got}
    mean = lambda key: float(np.mean([p[key] for p in nested.values()])) if nested else None  # noqa: E731
    verdicts = []
    if nested:
        verdicts.append(
            f"Intervals: on a flight never seen they held {mean('coverage'):.0%} of the true heights on "
            f"average ({coverage:.0%} target), {mean('mean_width_km'):.2f} km wide, each flight's method "
            "chosen on the other flights (the one falling least short of the target there, then the "
            f"narrowest); chosen on all flights, for predict: {chosen}."
        )
        for name, p in nested.items():
            if p["coverage"] < coverage - FAR_BELOW:
                verdicts.append(
                    f"On flight {name} the {coverage:.0%} intervals held only {p['coverage']:.0%} of the "
                    "true heights: far below the target. Its errors are larger than on the other flights "
                    "(a different cloud regime?): do not trust the error bars there."
                )
    return {
        "coverage": coverage,
        "methods": out,
        "chosen": chosen,
        "nested": {
            "per_flight": nested,
            "mean_coverage": mean("coverage"),
            "mean_width_km": mean("mean_width_km"),
        },
        "verdicts": verdicts,
    }


def save(run: RunFolder, calibration: dict | None) -> None:
    """The run's calibration of its prediction intervals (intervals.json), where it has one."""
    from cloudml_lib.base.outputs import write_text

    if calibration is not None:
        write_text(run.path / FILE, json.dumps(calibration))


def of_weights(cal: dict | None, weights: str, best: Path) -> dict | None:
    """A run's own calibration where it was made for the weights that predict (`weights`: their
    checkpoint.weights_sha256, recorded in intervals.json at the run's end; a calibration of an earlier
    release, without it, as it is); else None, said once: its residuals are another model's, so its coverage
    would be no measure of these weights' intervals (`best`: the best.pt predicting, for the message)."""
    if cal is None or cal.get("weights_sha256") in (None, weights):
        return cal
    log.warning(
        "%s holds other weights than the prediction intervals were calibrated on (%s recorded the weights of "
        "the run's end; best.pt was replaced, or put back from a backup, since): heights are given without "
        "intervals. Put back the best.pt of the run's end, or train a new run to its end.",
        best,
        FILE,
    )
    return None


def load(folder: Path) -> dict | None:
    """A folder's calibration, or None (with the reason logged) when it has none or it is unreadable."""
    files = RunFiles(Path(folder))
    cal = files.intervals()
    for d in files.damaged:
        log.warning("%s: no prediction intervals", d)
    return cal
