"""The baselines of the height: what the network must beat before its numbers mean anything, and what says
whether its frames add anything to the atmosphere.

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
- `trees`: gradient-boosted trees (scikit-learn's HistGradientBoostingRegressor, TREES: fixed settings,
  nothing chosen) on the same inputs.

With the flights' ERA5 predictors (data/predictors.py; read from the files beside the flights whatever
data.atmosphere says, so the baselines know the atmosphere where the network does not):
- `physical`: the cloud base at the lifting condensation level of the reanalysis surface air, the coupled
  marine boundary layer's assumption (Wood 2012, Mon. Wea. Rev. 140, 2373-2423: a well-mixed stratocumulus
  layer has its base at the surface air's LCL; Zuidema et al. 2009, J. Climate 22, 4652-4666: ship-measured
  bases up to 800 m match the LCL). base_km = lcl_height / 1000, the LCL of Romps (2017, J. Atmos. Sci. 74,
  3891-3900) from ERA5's 2 m temperature, 2 m dew point and surface pressure (data/atmosphere.py), above
  the sea's surface. No fitted parameter.
- `cold_top`: the cloud's top from its coldest pixels and the air below it, less a typical thickness:
  base_km = max(0, (t2m - T_cold) / LAPSE_RATE_K_PER_KM - CLOUD_THICKNESS_KM), T_cold the labelled frame's
  COLD_STATISTIC in kelvin, t2m ERA5's 2 m air temperature (K). The lapse rate 7.4 K/km is the middle of
  the marine boundary layer's bulk lapse rates of Zuidema et al. (2009; 7.6 to 7.2 K/km as the layer
  deepens from 0.8 to 2 km, from 156 radiosondes under stratocumulus; theirs from the sea's surface, here
  from the 2 m air, 0.5-1 K cooler: about 0.1 km lower); the thickness 0.3 km is the typical stratocumulus
  depth of "the upper few hundred metres" of the boundary layer (Wood 2012). No fitted parameter; only
  where every IR file scored states kelvin (counts have no temperature without a calibration).
- `atmosphere_trees`: the same gradient-boosted trees on the atmosphere's predictors alone (no frame, no sun);
- `atmosphere_brightness_trees`: the trees on the atmosphere's predictors and `trees`' inputs together.
Both physical retrievals answer the training labels' mean where a frame's inputs are unknown (no position or
time, a blank frame), as the network's inputs take the training mean there; a base below the sea is 0.
A baseline whose inputs are missing (no ERA5 file, no common predictor, frames not in kelvin, IR files in
different units) is left out with its reason (Fitted.left_out), logged and kept in the report.

`compare_baselines` scores them per test flight and pooled, names the best (lowest MAE) on each, and gives the
network's skill score against it, MAE skill = 1 - MAE(network) / MAE(baseline): above 0 the network adds
something, at or below 0 a baseline does as well. Choosing the best baseline on the test flight only makes the
comparison harder for the network: it never changes the network. `beyond_atmosphere` asks whether the frames
add anything to the atmosphere: on each test flight, the best model that reads the frames (the network, the
brightness baselines, `cold_top`, `atmosphere_brightness_trees`) against the best on the atmosphere alone
(`physical`, `atmosphere_trees`): the frames add nothing where even the best of them does no better.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import numpy as np

from cloudml_lib.base.config import DataConfig
from cloudml_lib.core.network.metrics import regression_metrics, time_blocks
from cloudml_lib.data import predictors
from cloudml_lib.data.dataset import CloudDataset
from cloudml_lib.data.preprocess import STAT_NAMES

log = logging.getLogger(__name__)

BASELINES = (
    "mean",
    "linear",
    "trees",
    "physical",
    "cold_top",
    "atmosphere_trees",
    "atmosphere_brightness_trees",
)
BRIGHTNESS = ("linear", "trees")  # the frame's brightness and the sun
ATMOSPHERE = ("physical", "cold_top", "atmosphere_trees", "atmosphere_brightness_trees")  # need ERA5
ATMOSPHERE_ONLY = ("physical", "atmosphere_trees")  # nothing of the frames: what the frames must add to
# beside the network, what reads the frames (their brightness): the verdict on the images takes their best
SEES_FRAMES = ("linear", "trees", "cold_top", "atmosphere_brightness_trees")
WORDS = {
    "mean": "predicting the training mean",
    "linear": "a linear model on the frame's brightness statistics and the sun's angles",
    "trees": "a gradient-boosted tree model on the frame's brightness statistics and the sun's angles",
    "physical": "the lifting condensation level of the ERA5 surface air (no fitted parameter)",
    "cold_top": "the cloud top from the frame's coldest pixels and the ERA5 2 m air temperature, less a "
    "typical thickness (no fitted parameter)",
    "atmosphere_trees": "a gradient-boosted tree model on the ERA5 atmosphere alone",
    "atmosphere_brightness_trees": "a gradient-boosted tree model on the ERA5 atmosphere, the frame's "
    "brightness statistics and the sun's angles",
}
SHORT = {
    "mean": "training mean",
    "linear": "linear on brightness",
    "trees": "trees on brightness",
    "physical": "LCL retrieval",
    "cold_top": "cold-top retrieval",
    "atmosphere_trees": "trees on atmosphere",
    "atmosphere_brightness_trees": "trees on atmosphere + brightness",
    "network": "the network",
}
RIDGE_ALPHAS = np.logspace(-3, 3, 13)
TREES = {"max_iter": 200, "learning_rate": 0.05, "max_leaf_nodes": 15, "min_samples_leaf": 10}
# The physical retrievals' constants (the module's docstring gives their sources)
LAPSE_RATE_K_PER_KM = 7.4  # marine boundary layer under stratocumulus, Zuidema et al. (2009)
CLOUD_THICKNESS_KM = 0.3  # typical stratocumulus, Wood (2012)
# the cloud's top: cloud wherever a twentieth of the swath is, and a few bad pixels do not move it
COLD_STATISTIC = "p5"
KELVIN = "K"  # preprocess.radiometry_of's name for an IR file in kelvin (K, kelvin, degK)


@dataclass
class Fitted:
    """What fit_predict gives: each baseline's heights (km) for every sample of each scored dataset, and each
    baseline left out with the reason, in words."""

    heights: dict[str, list[np.ndarray]]
    left_out: dict[str, str] = field(default_factory=dict)

    def leave_out(self, names, why: str, what: str) -> None:
        """`names` left out for `why`, said once in the log as `what`."""
        log.warning("%s left out: %s.", what, why)
        self.left_out.update({n: why for n in names})


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


def fit_predict(
    train: CloudDataset, scored: list[CloudDataset], seed: int = 0, data: DataConfig | None = None
) -> Fitted:
    """Each baseline fitted on `train`'s samples with a height, and its heights (km) for every sample of each
    of `scored` (Fitted.heights: {name: [predictions of scored[0], ...]}). The atmosphere's predictors are
    the datasets' own (CloudDataset.atmosphere), or with `data` read from the ERA5 files beside the flights
    (predictors.for_baselines). A baseline whose inputs are missing is left out with its reason."""
    has = train.has_height()
    y = train.targets_km()[has]
    mean = float(np.mean(y)) if y.size else np.nan
    fitted = Fitted({"mean": [np.full(len(d), mean) for d in scored]})
    x = inputs(train)[has]
    ok = np.isfinite(x).all(axis=1)
    units = units_problem(train, *scored)
    brightness = units or (None if ok.sum() >= 2 else "too few training samples")
    if brightness:
        fitted.leave_out(BRIGHTNESS, brightness, "The brightness baselines are")
    else:
        groups = _groups(train.flight_names()[has], train.frame_indices()[has])
        linear = _ridge(x[ok], y[ok], groups[ok])
        trees = _trees(x, y, seed)  # NaN: native
        fitted.heights["linear"] = [_linear_predict(linear, inputs(d)) for d in scored]
        fitted.heights["trees"] = [_predict(trees, inputs(d)) for d in scored]
    atmosphere = atmosphere_of([train, *scored], data)
    if isinstance(atmosphere, str):
        fitted.leave_out(ATMOSPHERE, atmosphere, "The atmosphere baselines are")
        return fitted
    (train_atm, *scored_atm), names = atmosphere
    _physical(fitted, scored, scored_atm, names, mean)
    if y.size < 2:
        fitted.leave_out(
            ("atmosphere_trees", "atmosphere_brightness_trees"), "too few training samples", "The trees are"
        )
        return fitted
    trees = _trees(train_atm[has], y, seed)
    fitted.heights["atmosphere_trees"] = [_predict(trees, a) for a in scored_atm]
    if units:
        fitted.leave_out(
            ("atmosphere_brightness_trees",), units, "The trees on the atmosphere and the brightness are"
        )
        return fitted
    both = _trees(np.concatenate([train_atm[has], x], axis=1), y, seed)
    fitted.heights["atmosphere_brightness_trees"] = [
        _predict(both, np.concatenate([a, inputs(d)], axis=1)) for a, d in zip(scored_atm, scored)
    ]
    return fitted


def _trees(x: np.ndarray, y: np.ndarray, seed: int):
    from sklearn.ensemble import HistGradientBoostingRegressor

    return HistGradientBoostingRegressor(**TREES, random_state=seed).fit(x, y)


def _predict(model, x: np.ndarray) -> np.ndarray:
    return model.predict(x) if len(x) else np.zeros(0)


def _linear_predict(model, z: np.ndarray) -> np.ndarray:
    """The ridge's heights where every input is finite, NaN elsewhere."""
    finite = np.isfinite(z).all(axis=1)
    pred = np.full(len(z), np.nan)
    if finite.any():
        pred[finite] = model.predict(z[finite])
    return pred


def atmosphere_of(
    datasets: list[CloudDataset], data: DataConfig | None = None
) -> tuple[list[np.ndarray], tuple[str, ...]] | str:
    """((N, P) each dataset's samples' atmosphere predictors, their names: one set for all), read from the
    flights' ERA5 files with `data` where the datasets' caches lack them (predictors.for_baselines); or why
    there are none, in words."""
    got = [d.atmosphere() for d in datasets]
    if len({n for _, n in got}) == 1 and got[0][1]:
        return [v for v, _ in got], got[0][1]
    if data is None:
        return "the flights' atmosphere was not read (no ERA5 predictors in their caches)"
    sizes = [len(d.caches) for d in datasets]
    caches, why = predictors.for_baselines([c for d in datasets for c in d.caches], data)
    if why:
        return why
    got = []
    for d, start in zip(datasets, np.cumsum([0, *sizes[:-1]])):
        view = copy.copy(d)  # the same samples, of the caches with their predictors
        view.caches = caches[start : start + len(d.caches)]
        got.append(view.atmosphere())
    if len({n for _, n in got}) != 1 or not got[0][1]:
        return "the flights' ERA5 files have no predictor in common"
    return [v for v, _ in got], got[0][1]


def lcl_base_km(lcl_height_m: np.ndarray) -> np.ndarray:
    """`physical`: the cloud base (km) at the lifting condensation level (m above the sea) of the surface
    air."""
    return np.asarray(lcl_height_m, np.float64) / 1000.0


def cold_top_base_km(t2m_k: np.ndarray, cold_k: np.ndarray) -> np.ndarray:
    """`cold_top`: the cloud base (km) a typical thickness below the top that the coldest pixels' temperature
    `cold_k` (K) puts LAPSE_RATE_K_PER_KM above the 2 m air at `t2m_k` (K); 0 where that is below the sea."""
    top_km = (np.asarray(t2m_k, np.float64) - np.asarray(cold_k, np.float64)) / LAPSE_RATE_K_PER_KM
    return np.maximum(top_km - CLOUD_THICKNESS_KM, 0.0)  # NaN stays NaN


def _physical(fitted: Fitted, scored, atmosphere: list[np.ndarray], names: tuple, mean: float) -> None:
    """The two physical retrievals (no fitted parameter) into `fitted`, or left out with the reason."""
    if "lcl_height" in names:
        k = names.index("lcl_height")
        fitted.heights["physical"] = _filled([lcl_base_km(a[:, k]) for a in atmosphere], mean, "physical")
    else:
        fitted.leave_out(
            ("physical",), "the flights' ERA5 files lack lcl_height (sp, t2m, d2m)", "physical is"
        )
    units = {c.name: c.radiometry.units for d in scored for c in d.caches}
    not_kelvin = {n: u for n, u in units.items() if u != KELVIN}
    if "t2m" not in names:
        fitted.leave_out(("cold_top",), "the flights' ERA5 files lack t2m", "cold_top is")
    elif not_kelvin:
        why = "the IR files state " + ", ".join(f"{n} {u}" for n, u in not_kelvin.items()) + ", not kelvin"
        fitted.leave_out(("cold_top",), why, "cold_top is")
    else:
        t2m, cold = names.index("t2m"), STAT_NAMES.index(COLD_STATISTIC)
        fitted.heights["cold_top"] = _filled(
            [cold_top_base_km(a[:, t2m], d.frame_stats()[:, cold]) for a, d in zip(atmosphere, scored)],
            mean,
            "cold_top",
        )


def _filled(heights: list[np.ndarray], mean: float, name: str) -> list[np.ndarray]:
    """`heights` with the training mean where unknown (said in the log)."""
    unknown = sum(int((~np.isfinite(h)).sum()) for h in heights)
    if unknown:
        log.info("%s: %d sample(s) without its inputs take the training mean %.3f km", name, unknown, mean)
    return [np.where(np.isfinite(h), h, mean) for h in heights]


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
    true_km: np.ndarray,
    model_km: np.ndarray,
    flights: np.ndarray,
    predicted: dict[str, np.ndarray],
    left_out: dict[str, str] | None = None,
) -> dict:
    """The baselines' metrics per test flight and pooled (`predicted`: each baseline's heights for the same
    samples as `true_km`), the best on each (lowest MAE) and the network's MAE skill against it and against
    each, those left out with the reason (`left_out`, Fitted.left_out), and with a baseline on the atmosphere
    alone whether the frames add anything to it (beyond_atmosphere)."""
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
    out = {
        "statistics": list(STAT_NAMES),
        "fitted_on": "the samples the network was fitted on (no validation or test sample)",
        "methods": methods,
        "best": {"per_flight": best, "pooled": _best(methods, model, ("overall",))},
        "left_out": dict(left_out or {}),
    }
    if any(k in methods for k in ATMOSPHERE_ONLY):

        def mae(m, *where):
            return _at(m, where).get("mae_km")

        out["beyond_atmosphere"] = {
            "per_flight": {
                str(f): beyond_atmosphere(
                    mae(model, "per_flight", str(f)),
                    {k: mae(m, "per_flight", str(f)) for k, m in methods.items()},
                )
                for f in names
            },
            "pooled": beyond_atmosphere(
                mae(model, "overall"), {k: mae(m, "overall") for k, m in methods.items()}
            ),
        }
    return out


def beyond_atmosphere(network_mae: float | None, maes: dict[str, float | None]) -> dict | None:
    """Whether the frames add anything to the atmosphere on one test flight: the best model that reads them
    (the network, or one of SEES_FRAMES) against the best on the atmosphere alone (ATMOSPHERE_ONLY), each
    named with its MAE, and the MAE skill of the one against the other (`frames_add`: the frames' is lower).
    None without a baseline on the atmosphere alone."""
    finite = lambda v: v is not None and bool(np.isfinite(v))  # noqa: E731
    alone = {k: maes[k] for k in ATMOSPHERE_ONLY if finite(maes.get(k))}
    frames = {"network": network_mae} if finite(network_mae) else {}
    frames |= {k: maes[k] for k in SEES_FRAMES if finite(maes.get(k))}
    if not alone or not frames:
        return None
    a, f = min(alone, key=alone.get), min(frames, key=frames.get)
    return {
        "frames_model": f,
        "frames_mae_km": float(frames[f]),
        "atmosphere_model": a,
        "atmosphere_mae_km": float(alone[a]),
        "skill": skill(frames[f], alone[a]),
        "frames_add": bool(frames[f] < alone[a]),
    }


def _at(d: dict, where: tuple) -> dict:
    for k in where:
        d = (d or {}).get(k)
    return d or {}


def _best(methods: dict, model: dict, where: tuple) -> dict | None:
    """The baseline of lowest MAE at `where` (("overall",) or ("per_flight", flight)), with the network's MAE
    skill against it and against every baseline."""
    mine = _at(model, where).get("mae_km")
    maes = {name: _at(m, where).get("mae_km") for name, m in methods.items()}
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
