"""Whether a flight's inputs are like those the model was trained on: the domain check.

A network cannot say where it extrapolates: asked about a flight whose sea is warmer than any it was trained
on, it answers inside the heights it learned, with no sign of doubt. So what the network sees of each frame
besides its pixels (the sun's zenith angle and its azimuth's sine and cosine; the frame's brightness
statistics where the run gives them to it, data.radiometry; the atmosphere's predictors where it reads them,
data.atmosphere) is compared with the same inputs of the samples it was trained on (the part of the training
flights trained on), recorded in best.pt when the run starts (`Domain.fit`, `to_dict`):

- **ranges**: each input's lowest and highest value in training, widened by a margin (a tenth of that span,
  and at least the input's measurement floor: MARGIN_FLOOR; the atmosphere's: a reanalysis' error at a
  point, predictors.SPREAD_FLOOR). A frame with an input beyond its widened range is outside, and the input
  is named;
- **a distance**: the Mahalanobis distance of the frame's inputs (each standardised by its training mean and
  spread) from the training samples', with scikit-learn's Ledoit-Wolf covariance (a shrunk estimate: the
  inputs are few and correlated, the samples a few hundred). A frame farther than every training sample by a
  quarter (DISTANCE_FACTOR x the largest training distance) is outside too: a combination of inputs training
  never saw, each inside its own range (a warm sea under a low sun, say).

An input that is missing at a frame (no sun angle, no position for the atmosphere) is left out of both tests
at that frame: the network sees the training mean there, which is inside by construction. The check judges
inputs, not heights: a frame outside has a height that is an extrapolation whatever its value (predict's
cloud_base_height_qc `inputs_outside_training`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from cloudml_lib.data import era5
from cloudml_lib.data.predictors import SPREAD_FLOOR
from cloudml_lib.data.preprocess import STAT_NAMES

ANGLES = ("solar_zenith_angle", "sun_azimuth_sine", "sun_azimuth_cosine")
MARGIN_SHARE = 0.1  # of an input's training span, on each side
MARGIN_FLOOR = {"degree": 2.0, "1": 0.05, "K": 0.5}  # about what the input is measured to (else 0)
DISTANCE_FACTOR = 1.25  # a frame is outside beyond this times the largest training sample's distance
MIN_DISTANCE = 1.0  # and never within one standard deviation (training samples all alike: their distances 0)
NAMED = 3  # the inputs a flight's sentence names at most

# (what the input is, in words; the word for a value above and below every training sample's)
_STAT_WORDS = {"mean": "frames' mean brightness", "std": "frames' brightness spread"}
_TEMPERATURES = {"t2m", "sea_surface_temperature"}


def describe(name: str, units: str) -> tuple[str, str, str]:
    """(input in words, word above, word below) for the flight's sentence."""
    if name == "solar_zenith_angle":
        return "sun's zenith angle", "larger (a lower sun)", "smaller (a higher sun)"
    if name.startswith("sun_azimuth"):
        return f"sun's direction from the heading ({name.rsplit('_', 1)[1]})", "larger", "smaller"
    warm = units == "K" and (name in _TEMPERATURES or name in STAT_NAMES)
    up, down = ("warmer", "colder") if warm else ("higher", "lower")
    if name in STAT_NAMES:
        q = int(name[1:]) if name[1:].isdigit() else 0
        nth = {1: "st", 2: "nd", 3: "rd"}.get(q % 10 if q % 100 not in (11, 12, 13) else 0, "th")
        return _STAT_WORDS.get(name, f"frames' {name[1:]}{nth} brightness percentile"), up, down
    if name in era5.PREDICTORS:
        words = {"sea_surface_temperature": "sea's surface temperature"}
        return words.get(name, era5.PREDICTORS[name][2]), up, down
    return name, up, down


def inputs_of(sza_deg, azimuth_deg, stats=None, atmosphere=None) -> np.ndarray:
    """(N, F) the inputs the check compares, in `Domain.names` order: the zenith angle (degrees), the
    azimuth's sine and cosine (NaN where unknown), then the statistics (N, K) and the predictors (N, P) where
    given."""
    sza = np.asarray(sza_deg, np.float64).reshape(-1)
    az = np.radians(np.asarray(azimuth_deg, np.float64).reshape(-1))
    parts = [np.stack([sza, np.sin(az), np.cos(az)], 1)]
    for extra in (stats, atmosphere):
        if extra is not None and np.size(extra):
            parts.append(np.asarray(extra, np.float64).reshape(sza.size, -1))
    return np.concatenate(parts, 1)


def names_of(radiometry_units: str | None, atmosphere: list[str] | None) -> tuple[list[str], list[str]]:
    """(names, units) of the inputs a run's network sees: the angles, its statistics, its predictors."""
    names, units = list(ANGLES), ["degree", "1", "1"]
    if radiometry_units is not None:
        names += list(STAT_NAMES)
        units += [radiometry_units] * len(STAT_NAMES)
    for name in atmosphere or ():
        names.append(name)
        units.append(era5.PREDICTORS[name][0] if name in era5.PREDICTORS else "")
    return names, units


@dataclass
class Judged:
    """A flight's frames against the training inputs: `beyond` (N, F) +1 above, -1 below the widened range,
    0 inside or missing; `distance` (N,) Mahalanobis; `outside` (N,) either test failed."""

    beyond: np.ndarray
    distance: np.ndarray
    outside: np.ndarray
    values: np.ndarray

    def subset(self, mask: np.ndarray) -> Judged:
        return Judged(self.beyond[mask], self.distance[mask], self.outside[mask], self.values[mask])


@dataclass
class Domain:
    """The training samples' inputs, as best.pt records them (`to_dict`), and the test of a new frame's."""

    names: list[str]
    units: list[str]
    low: np.ndarray  # each input's lowest training value
    high: np.ndarray  # and highest
    margin: np.ndarray  # how far beyond them a value is still inside
    mean: np.ndarray  # for the distance: each input's training mean and spread
    std: np.ndarray
    precision: np.ndarray  # (F, F) the inverse Ledoit-Wolf covariance of the standardised inputs
    threshold: float  # the distance beyond which a frame is outside
    n: int  # training samples
    flights: list[str]

    @classmethod
    def fit(cls, values: np.ndarray, names: list[str], units: list[str], flights: list[str]) -> Domain:
        """From the training samples' inputs (N, F), NaN where one is missing."""
        from sklearn.covariance import LedoitWolf

        values = np.asarray(values, np.float64)
        known = np.isfinite(values).any(0)  # an input never known in training (no heading anywhere, say)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # its column: NaN, and never judged (judge)
            low, high = np.nanmin(values, 0), np.nanmax(values, 0)
            mean, std = np.nanmean(values, 0), np.nanstd(values, 0)
        floor = np.array([MARGIN_FLOOR.get(u, SPREAD_FLOOR.get(u, 0.0)) for u in units])
        margin = np.where(known, np.maximum(MARGIN_SHARE * (high - low), floor), 0.0)
        mean = np.where(known, mean, 0.0)
        std = np.where(known & (std > 0), np.maximum(std, floor), np.where(floor > 0, floor, 1.0))
        z = np.where(np.isfinite(values), (values - mean) / std, 0.0)
        precision = LedoitWolf().fit(z).precision_ if len(z) > 1 else np.eye(len(names))
        d = _mahalanobis(z, precision)
        return cls(
            list(names), list(units), low, high, margin, mean, std, precision,
            max(float(DISTANCE_FACTOR * d.max()), MIN_DISTANCE) if d.size else float("inf"), int(len(values)),
            list(flights),
        )  # fmt: skip

    def judge(self, values: np.ndarray) -> Judged:
        """Each frame's inputs (N, F, `inputs_of`) against the training samples'."""
        values = np.asarray(values, np.float64).reshape(-1, len(self.names))
        with np.errstate(invalid="ignore"):
            above = values > self.high + self.margin  # NaN (missing here, or never known in training): False
            below = values < self.low - self.margin
        beyond = (above.astype(np.int8) - below.astype(np.int8)).astype(np.int8)
        known = np.isfinite(values) & np.isfinite(self.low)
        z = np.where(known, (values - self.mean) / self.std, 0.0)
        distance = _mahalanobis(z, self.precision)
        outside = (beyond != 0).any(1) | (distance > self.threshold)
        return Judged(beyond, distance, outside, values)

    def words(self, flight: str, judged: Judged, frames: str = "frames") -> str:
        """The flight's sentence: how many of its `frames` (frames, heights, labelled frames) lie outside,
        which inputs and how; or that none does."""
        n, out = len(judged.outside), int(judged.outside.sum())
        trained = f"the {len(self.flights)} training flight{'s' if len(self.flights) != 1 else ''}"
        where = "come from frames that lie" if frames == "heights" else "lie"
        if not n:
            return f"flight {flight}: no {frames} to compare with the inputs of {trained}"
        if not out:
            return f"flight {flight}: all {n} of its {frames} {where} inside the inputs of {trained}"
        said = []
        counts = (judged.beyond != 0).sum(0)
        for k in np.argsort(-counts, kind="stable")[:NAMED]:
            if not counts[k]:
                break
            up = int((judged.beyond[:, k] > 0).sum()) >= int((judged.beyond[:, k] < 0).sum())
            what, above, below = describe(self.names[k], self.units[k])
            column = judged.values[:, k][judged.beyond[:, k] != 0]
            here, edge = (np.nanmax(column), self.high[k]) if up else (np.nanmin(column), self.low[k])
            unit = {"1": "", "": "", "degree": " degrees"}.get(self.units[k], f" {self.units[k]}")
            said.append(
                f"its {what} is {above if up else below} than any training flight's at {int(counts[k])} of "
                f"them ({_num(here)}{unit} here, {_num(edge)}{unit} {'at most' if up else 'at least'} "
                "in training)"
            )
        joint = int((judged.outside & ~(judged.beyond != 0).any(1)).sum())
        if joint:
            said.append(
                f"at {joint} of them the inputs together lie farther from the training samples than any of "
                f"those (Mahalanobis distance above {self.threshold:.1f})"
            )
        return (
            f"flight {flight}: {out} of its {n} {frames} ({out / n:.0%}) {where} outside the inputs of "
            f"{trained}: " + "; ".join(said) + ", so heights there are an extrapolation"
        )

    def to_dict(self) -> dict:
        arrays = ("low", "high", "margin", "mean", "std")
        out = {k: [float(v) for v in getattr(self, k)] for k in arrays}
        out["precision"] = [[float(v) for v in row] for row in self.precision]
        return {
            "names": list(self.names), "units": list(self.units), **out, "threshold": self.threshold,
            "n": self.n, "flights": list(self.flights),
            "method": "ranges widened by a tenth of their span (at least MARGIN_FLOOR), and the Mahalanobis "
            "distance (Ledoit-Wolf) beyond 1.25 x the largest training sample's",
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d) -> Domain:
        """best.pt's record, checked (ValueError naming what is wrong: read as untrusted)."""
        if not isinstance(d, dict):
            raise ValueError(f"not a record ({type(d).__name__})")
        names, units = d.get("names"), d.get("units")
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise ValueError("its input names are not a list of names")
        f = len(names)
        if not (isinstance(units, list) and len(units) == f and all(isinstance(u, str) for u in units)):
            raise ValueError("its units do not match its inputs")
        arrays = {}
        for key in ("low", "high", "margin", "mean", "std"):
            a = np.asarray(d.get(key), np.float64) if isinstance(d.get(key), list) else np.zeros(0)
            if a.shape != (f,) or np.isinf(a).any():
                raise ValueError(f"{key} is not {f} numbers")
            arrays[key] = a
        p = np.asarray(d.get("precision"), np.float64) if isinstance(d.get("precision"), list) else None
        if p is None or p.shape != (f, f) or not np.isfinite(p).all():
            raise ValueError(f"its precision matrix is not {f} x {f} finite numbers")
        if not ((arrays["std"] > 0).all() and (arrays["margin"] >= 0).all()):
            raise ValueError("a spread is not positive or a margin is negative")
        threshold, n, flights = d.get("threshold"), d.get("n"), d.get("flights")
        if not (isinstance(threshold, (int, float)) and threshold > 0 and isinstance(n, int) and n > 0):
            raise ValueError("its distance threshold or sample count is not a positive number")
        if not (isinstance(flights, list) and all(isinstance(x, str) for x in flights)):
            raise ValueError("its flights are not a list of names")
        return cls(list(names), list(units), **arrays, precision=p, threshold=float(threshold), n=n,
                   flights=list(flights))  # fmt: skip


UNCHECKED = (
    "its inputs cannot be compared with the training flights': the run was made before CloudML recorded "
    "them (a new run records them in best.pt)"
)


def recorded(record) -> tuple[Domain | None, str]:
    """(best.pt's domain, "") or (None, why the flights cannot be checked): absent in runs made before the
    check, or damaged."""
    if record is None:
        return None, UNCHECKED
    try:
        return Domain.from_dict(record), ""
    except ValueError as e:
        return (
            None,
            "its inputs cannot be compared with the training flights': best.pt's record of them is damaged "
            f"({e})",
        )


def dataset_inputs(dataset) -> np.ndarray:
    """(N, F) the inputs of a CloudDataset's samples its scalers' network sees (`names_of`'s order)."""
    s = dataset.scalers
    atmosphere = dataset.atmosphere()[0] if s.atmosphere else None
    stats = dataset.frame_stats() if s.radiometry else None
    return inputs_of(dataset.sza_deg(), dataset.azimuth_deg(), stats, atmosphere)


def of_dataset(dataset) -> Domain:
    """The domain of the samples of a CloudDataset (the part trained on): the inputs its network sees."""
    s = dataset.scalers
    names, units = names_of(s.radiometry_units if s.radiometry else None, s.atmosphere)
    return Domain.fit(dataset_inputs(dataset), names, units, sorted({c.name for c in dataset.caches}))


def _mahalanobis(z: np.ndarray, precision: np.ndarray) -> np.ndarray:
    return np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", z, precision, z), 0.0))


def _num(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}"
