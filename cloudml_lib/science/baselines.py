"""The baselines of the height: what the network must beat before its numbers mean anything.

Every IR cloud-height retrieval starts from the cloud's brightness temperature (colder is higher), and the
published field reports a trivial and a physical baseline beside every retrieval. Each baseline here is fitted
on the samples the network was fitted on (the part of the training flights trained on: nothing of the
validation data or the test flights) and scored on the same test samples:
- `mean`: the training labels' mean height for every frame (R2 about 0 by construction);
- `linear`: a ridge regression (scikit-learn, on standardised inputs; its penalty chosen by cross-validation
  that leaves out one training flight at a time, or one time block of a single flight: neighbouring frames
  are nearly alike, so leaving out single samples would choose too little penalty) on the labelled frame's
  radiometric statistics in the units the IR file states (data/preprocess.py STAT_NAMES: eight percentiles,
  the mean and the spread of the raw frame, never the per-frame reading the network's frames get) and the
  sun's angles as the network sees them;
- `trees`: gradient-boosted trees (scikit-learn's HistGradientBoostingRegressor, fixed settings, nothing
  chosen) on the same inputs.

`compare_baselines` scores them per test flight and pooled, names the best (lowest MAE) on each, and gives the
network's skill score against it, MAE skill = 1 - MAE(network) / MAE(baseline): above 0 the network adds
something, at or below 0 a baseline does as well. Choosing the best baseline on the test flight only makes the
comparison harder for the network: it never changes the network.
"""

from __future__ import annotations

import logging

import numpy as np

from cloudml_lib.core.network.metrics import regression_metrics, time_blocks
from cloudml_lib.data.dataset import CloudDataset
from cloudml_lib.data.preprocess import STAT_NAMES

log = logging.getLogger(__name__)

BASELINES = ("mean", "linear", "trees")
WORDS = {
    "mean": "predicting the training mean",
    "linear": "a linear model on the frame's brightness statistics and the sun's angles",
    "trees": "a gradient-boosted tree model on the frame's brightness statistics and the sun's angles",
}
SHORT = {"mean": "training mean", "linear": "linear on brightness", "trees": "trees on brightness"}
RIDGE_ALPHAS = np.logspace(-3, 3, 13)
TREES = {"max_iter": 200, "learning_rate": 0.05, "max_leaf_nodes": 15, "min_samples_leaf": 10}


def inputs(dataset: CloudDataset) -> np.ndarray:
    """(N, K + 3): each sample's labelled frame's radiometric statistics (raw, the file's units) and the
    angles as the network sees them."""
    return np.concatenate([dataset.frame_stats(), dataset.angles()], axis=1)


def units_problem(*datasets: CloudDataset) -> str | None:
    """Why the brightness baselines cannot compare these flights (their IR files state different units), or
    None."""
    units = {c.name: c.radiometry.units for d in datasets for c in d.caches}
    if len(set(units.values())) <= 1:
        return None
    return "the IR files state different units (" + ", ".join(f"{n} {u}" for n, u in units.items()) + ")"


def fit_predict(train: CloudDataset, scored: list[CloudDataset], seed: int = 0) -> dict[str, list]:
    """Each baseline fitted on `train`'s samples with a height, and its heights (km) for every sample of each
    of `scored`: {name: [predictions of scored[0], ...]}. The brightness baselines are left out (with a
    warning) where the flights' IR files state different units, or no training sample has finite
    statistics."""
    from sklearn.ensemble import HistGradientBoostingRegressor

    has = train.has_height()
    y = train.targets_km()[has]
    out = {"mean": [np.full(len(d), float(np.mean(y)) if y.size else np.nan) for d in scored]}
    x = inputs(train)[has]
    ok = np.isfinite(x).all(axis=1)
    problem = units_problem(train, *scored) or (None if ok.sum() >= 2 else "too few training samples")
    if problem:
        log.warning("The brightness baselines are left out: %s.", problem)
        return out
    groups = _groups(train.flight_names()[has], train.frame_indices()[has])
    linear = _ridge(x[ok], y[ok], groups[ok])
    trees = HistGradientBoostingRegressor(**TREES, random_state=seed).fit(x, y)  # NaN: native
    out["linear"], out["trees"] = [], []
    for d in scored:
        z = inputs(d)
        finite = np.isfinite(z).all(axis=1)
        pred = np.full(len(d), np.nan)
        if finite.any():
            pred[finite] = linear.predict(z[finite])
        out["linear"].append(pred)
        out["trees"].append(trees.predict(z) if len(d) else np.zeros(0))
    return out


def _groups(flights: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """The groups the linear baseline's penalty is cross-validated over: the training flights, or with one
    flight its time blocks (core/metrics.time_blocks)."""
    if len(set(flights.tolist())) >= 2:
        return np.asarray(flights)
    groups = np.zeros(len(frames), np.int64)
    for k, block in enumerate(time_blocks(frames)):
        groups[block] = k
    return groups


def _ridge(x: np.ndarray, y: np.ndarray, groups: np.ndarray):
    """The linear baseline: standardised inputs, a ridge penalty chosen over RIDGE_ALPHAS by cross-validation
    over `groups` (one left out at a time, at most 5 folds); a moderate fixed one with fewer than 2 groups."""
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import GridSearchCV, GroupKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    model = make_pipeline(StandardScaler(), Ridge(alpha=1.0))
    n_groups = len(np.unique(groups))
    if n_groups < 2:
        return model.fit(x, y)
    search = GridSearchCV(
        model,
        {"ridge__alpha": RIDGE_ALPHAS},
        cv=GroupKFold(n_splits=min(5, n_groups)),
        scoring="neg_mean_absolute_error",
    )
    return search.fit(x, y, groups=groups).best_estimator_


def compare_baselines(
    true_km: np.ndarray, model_km: np.ndarray, flights: np.ndarray, predicted: dict[str, np.ndarray]
) -> dict:
    """The baselines' metrics per test flight and pooled (`predicted`: each baseline's heights for the same
    samples as `true_km`), the best on each (lowest MAE) and the network's MAE skill against it and against
    each."""
    true_km, model_km, flights = (np.asarray(a) for a in (true_km, model_km, flights))
    names = list(dict.fromkeys(flights.tolist()))
    methods = {}
    for name, pred in predicted.items():
        pred = np.asarray(pred, np.float64)
        methods[name] = {
            "overall": regression_metrics(true_km, pred),
            "per_flight": {
                str(f): regression_metrics(true_km[flights == f], pred[flights == f]) for f in names
            },
        }
    model = {
        "overall": regression_metrics(true_km, model_km),
        "per_flight": {
            str(f): regression_metrics(true_km[flights == f], model_km[flights == f]) for f in names
        },
    }
    best = {str(f): _best(methods, model, ("per_flight", str(f))) for f in names}
    return {
        "statistics": list(STAT_NAMES),
        "fitted_on": "the samples the network was fitted on (no validation or test sample)",
        "methods": methods,
        "best": {"per_flight": best, "pooled": _best(methods, model, ("overall",))},
    }


def _best(methods: dict, model: dict, where: tuple) -> dict | None:
    """The baseline of lowest MAE at `where` (("overall",) or ("per_flight", flight)), with the network's MAE
    skill against it and against every baseline."""

    def at(d):
        for k in where:
            d = (d or {}).get(k)
        return d or {}

    mine = at(model).get("mae_km")
    maes = {name: at(m).get("mae_km") for name, m in methods.items()}
    maes = {k: v for k, v in maes.items() if v is not None and np.isfinite(v)}
    if not maes or mine is None or not np.isfinite(mine):
        return None
    name = min(maes, key=lambda k: (maes[k], BASELINES.index(k) if k in BASELINES else len(BASELINES)))
    return {
        "name": name,
        "mae_km": maes[name],
        "model_mae_km": mine,
        "skill": skill(mine, maes[name]),
        "skill_against": {k: skill(mine, v) for k, v in maes.items()},
    }


def skill(model_mae: float, baseline_mae: float) -> float | None:
    """MAE skill score: 1 - model / baseline (1 perfect, 0 as good as the baseline, below 0 worse)."""
    return 1.0 - model_mae / baseline_mae if baseline_mae > 0 else None
