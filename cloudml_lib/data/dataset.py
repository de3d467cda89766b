"""Samples for training: flight splits, scalers, augmentation and the epoch order.

- Splits are by role (splits.py): the test flights (`data.test_flights`) are scored once, at the end;
  validation data come from the training flights (`data.validation`); the scalers (angles, target) are
  fitted on the rest of the training flights only, the part the model trains on.
- The cloud flag a sample carries is `data.cloud_flag`'s: a cloud base in the label range (base_in_range;
  `cloud_classes` tells clear sky, high cloud alone and a base below the range apart), or any CPL layer
  (any_layer, runs made before that setting).
- The sun azimuth the network sees is relative to the aircraft heading (`data.sun_azimuth: relative`,
  where the sun acts on the image), or from the ground (`ground`, as nav/sunAzGrd).
- With `data.radiometry: statistics` the network's scalar inputs also hold the labelled frame's radiometric
  statistics (preprocess.STAT_NAMES, in the units the IR file states), on one scale for all of them (so that a
  difference of two keeps its meaning in kelvin or counts) fitted on the part trained on: what the per-frame
  reading of the frames removes.
- Augmentation works on the float tensors (never through an 8-bit image), on training samples
  only, and is a function of (seed, epoch, sample): a horizontal flip, brightness/contrast jitter
  and random erasing. The flip mirrors the image across a line fixed to the aircraft (its flight
  axis when rows run along-track), so it mirrors the azimuth across that line: a relative azimuth
  r -> -r, a ground azimuth a -> 2 * heading - a (`360 - a` is right only when heading north).
  Without a heading no flip can keep image and angle consistent: such samples are never flipped.
- The epoch order is a function of (seed, epoch), so a resumed run can slice it instead of
  replaying batches.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
from torch.utils.data import Dataset

from cloudml_lib.base.config import ANGLE_INPUTS as ANGLE_INPUTS  # base/config.py's, named here too
from cloudml_lib.base.config import STAT_NAMES as STAT_NAMES
from cloudml_lib.base.config import Config
from cloudml_lib.base.config import n_scalar_inputs as n_scalar_inputs
from cloudml_lib.base.errors import DataError
from cloudml_lib.data import predictors
from cloudml_lib.data.cache import FlightCache, load_caches
from cloudml_lib.data.cpl import BASE_IN_RANGE, cloud_classes
from cloudml_lib.data.flights import FoundFlight, Notes, format_table, summary_rows
from cloudml_lib.data.preprocess import Backend
from cloudml_lib.data.splits import Split, check_parts, choose_split

log = logging.getLogger(__name__)

FLIP_PROB, ERASE_PROB = 0.5, 0.25
CONTRAST, BRIGHTNESS = 0.15, 0.15  # multiplicative and additive jitter on z-scored frames


@dataclass
class Scalers:
    """Standardisation of the solar zenith angle and the target, fitted on training flights (the azimuth
    enters as its sine and cosine, which need none), and with data.radiometry the radiometric statistics'
    scale: (value - radiometry_offset) / radiometry_scale for each percentile and the mean, the spread divided
    by radiometry_scale (None: the run does not give the network radiometry, as every run before it)."""

    sza_mean: float
    sza_std: float
    cbh_mean: float
    cbh_std: float
    radiometry_offset: float | None = None
    radiometry_scale: float | None = None
    radiometry_units: str | None = None  # the units the statistics were in (the IR files'): checked on use
    # with data.atmosphere: the predictors the network reads (data/predictors.py), in order, and each one's
    # mean and spread over the part trained on (None: no atmosphere, as every run before the setting)
    atmosphere: list[str] | None = None
    atmosphere_mean: list[float] | None = None
    atmosphere_std: list[float] | None = None

    @property
    def radiometry(self) -> bool:
        return self.radiometry_scale is not None

    @property
    def n_atmosphere(self) -> int:
        return len(self.atmosphere or ())

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> Scalers:
        numbers = ("sza_mean", "sza_std", "cbh_mean", "cbh_std", "radiometry_offset", "radiometry_scale")
        out = {k: float(d[k]) for k in numbers if d.get(k) is not None}  # the last two: with radiometry
        units = d.get("radiometry_units")
        scalers = cls(**out, radiometry_units=None if units is None else str(units))
        names = d.get("atmosphere")
        if names is None:
            return scalers
        mean, std = d.get("atmosphere_mean"), d.get("atmosphere_std")
        if not (
            isinstance(names, list)
            and all(isinstance(n, str) for n in names)
            and all(isinstance(x, list) and len(x) == len(names) for x in (mean, std))
            and all(isinstance(v, (int, float)) and np.isfinite(v) for v in [*mean, *std])
            and all(v > 0 for v in std)
        ):
            raise ValueError(
                "the scalers' atmosphere must be a list of predictor names with one finite mean and one "
                f"positive spread each, not {names!r}, {mean!r}, {std!r}"
            )
        return replace(
            scalers,
            atmosphere=list(names),
            atmosphere_mean=[float(v) for v in mean],
            atmosphere_std=[float(v) for v in std],
        )

    def check_units(self, units: str, where: str) -> None:
        """A model that saw the brightness statistics in some units reads only those: `units` (what the IR
        file of `where` states) must be the training flights'."""
        if self.radiometry and self.radiometry_units is not None and units != self.radiometry_units:
            trained = self.radiometry_units
            raise DataError(
                f"{where}: its IR file states its numbers in {units}, but this model was trained on "
                f"brightness statistics in {trained} (data.radiometry: statistics): it would read them on "
                f"the wrong scale. Give the file in {trained} (its units attribute, with scale_factor and "
                "add_offset where it is packed), or use a model trained with data.radiometry: none."
            )


def _mean_std(x: np.ndarray) -> tuple[float, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return 0.0, 1.0
    return float(x.mean()), float(max(x.std(), 1e-6))


def model_azimuth(saa_deg: np.ndarray, heading_deg: np.ndarray, mode: str) -> np.ndarray:
    """The sun azimuth the network sees (degrees, 0..360): relative to the heading (NaN where there is none),
    or from the ground as read."""
    saa = np.asarray(saa_deg, np.float64)
    return np.mod(saa - np.asarray(heading_deg, np.float64), 360.0) if mode == "relative" else saa


def mirror_line(heading_deg: np.ndarray, mode: str, along_track_axis: str) -> np.ndarray:
    """The azimuth (in the network's convention) of the line the horizontal flip mirrors across; NaN where no
    heading is known (no flip). Flipping the columns mirrors across the rows' direction: the flight axis
    when the aircraft flies along the rows, the cross-track axis (90 degrees off) when along the columns."""
    axis = 0.0 if along_track_axis == "rows" else 90.0
    heading = np.asarray(heading_deg, np.float64)
    return np.where(np.isfinite(heading), axis + (heading if mode == "ground" else 0.0), np.nan)


def scalar_inputs(sza_deg, azimuth_deg, scalers: Scalers, stats=None, atmosphere=None) -> np.ndarray:
    """(N, 3) float32 network scalars: the standardised zenith angle (the training mean where unknown) and
    the azimuth's sine and cosine (0, 0 where unknown: no direction), so 359 and 1 degrees lie close; with the
    scalers' radiometry, (N, 3 + K): then the frames' radiometric statistics `stats` (N, K), on the scalers'
    scale (0, the training mean, where one is not finite); with the scalers' atmosphere, then the predictors
    `atmosphere` (N, P), each standardised (0, the training mean, where one is not finite)."""
    sza = np.asarray(sza_deg, np.float64).reshape(-1)
    az = np.radians(np.asarray(azimuth_deg, np.float64).reshape(-1))
    z = np.where(np.isfinite(sza), (sza - scalers.sza_mean) / scalers.sza_std, 0.0)
    known = np.isfinite(az)
    parts = [np.stack([z, np.where(known, np.sin(az), 0.0), np.where(known, np.cos(az), 0.0)], 1)]
    if scalers.radiometry:
        assert stats is not None, "a model with radiometry needs the frames' statistics"
        parts.append(
            scaled_statistics(np.asarray(stats, np.float64).reshape(len(sza), len(STAT_NAMES)), scalers)
        )
    if scalers.atmosphere:
        assert atmosphere is not None, "a model that reads the atmosphere needs its predictors"
        parts.append(
            scaled_atmosphere(
                np.asarray(atmosphere, np.float64).reshape(len(sza), scalers.n_atmosphere), scalers
            )
        )
    return np.concatenate(parts, 1).astype(np.float32)


def scaled_atmosphere(values: np.ndarray, scalers: Scalers) -> np.ndarray:
    """(N, P) the atmosphere's predictors standardised by the scalers; 0 (the training mean) where one is not
    finite."""
    x = (values - np.asarray(scalers.atmosphere_mean)) / np.asarray(scalers.atmosphere_std)
    return np.where(np.isfinite(x), x, 0.0)


SPREAD = STAT_NAMES.index("std")  # the one statistic that is a spread, not a place on the scale


def scaled_statistics(stats: np.ndarray, scalers: Scalers) -> np.ndarray:
    """(N, K) radiometric statistics on the scalers' scale; 0 (the training mean) where one is not finite."""
    x = (stats - scalers.radiometry_offset) / scalers.radiometry_scale
    x[:, SPREAD] = stats[:, SPREAD] / scalers.radiometry_scale
    return np.where(np.isfinite(x), x, 0.0)


def fit_scalers(train: list[FlightCache], radiometry: str = "none", atmosphere: str = "none") -> Scalers:
    """The scalers of the part trained on (`train`); with data.radiometry `radiometry` (not none) the scale
    of the radiometric statistics too: their mean frame's mean brightness, and the spread of every percentile
    and mean over them; with data.atmosphere `atmosphere` (not none) and the caches' predictors
    (predictors.attach), each predictor's mean and spread over `train`."""
    cat = lambda attr: np.concatenate([getattr(c, attr) for c in train]).astype(np.float64)  # noqa: E731
    sza, cbh = _mean_std(cat("sza_deg")), _mean_std(cat("cbh_km"))
    scalers = Scalers(sza[0], sza[1], cbh[0], cbh[1])
    if atmosphere != "none" and train and train[0].atmosphere is not None:
        names = list(train[0].atmosphere_names)
        assert all(list(c.atmosphere_names) == names for c in train), "one set of predictors per run"
        values = np.concatenate([c.atmosphere for c in train]).astype(np.float64)  # (N, P)
        fitted = [_mean_std(values[:, k]) for k in range(len(names))]
        fitted = [(m, _spread_floor(name, s)) for name, (m, s) in zip(names, fitted)]
        scalers = replace(
            scalers,
            atmosphere=names,
            atmosphere_mean=[m for m, _ in fitted],
            atmosphere_std=[s for _, s in fitted],
        )
    if radiometry == "none":
        return scalers
    stats = np.concatenate([c.frame_stats for c in train]).astype(np.float64)  # (N, K)
    places = np.delete(stats, SPREAD, axis=1)
    offset = _mean_std(stats[:, STAT_NAMES.index("mean")])[0]
    scale = _mean_std(places.reshape(-1))[1]
    units = train[0].radiometry.units if train else None
    return replace(scalers, radiometry_offset=offset, radiometry_scale=scale, radiometry_units=units)


def _spread_floor(name: str, spread: float) -> float:
    """A predictor's spread over the part trained on, at least predictors.SPREAD_FLOOR of its unit (the size
    of a reanalysis' error at a point): over one flight, or a short stretch of one, the atmosphere barely
    varies, and a spread of almost nothing would put another flight's value hundreds of spreads away."""
    floor = predictors.spread_floor(name)
    if spread >= floor:
        return spread
    log.warning(
        "atmosphere: %s varies by %.3g over the part trained on (one flight, or a short stretch of one): "
        "scaled by %.3g instead, the size of a reanalysis' error, so that another flight's value stays "
        "within reach; more training flights give the network more than one atmosphere to learn from",
        name,
        spread,
        floor,
    )
    return floor


def check_radiometry(caches: list[FlightCache]) -> None:
    """data.radiometry's statistics are comparable across the run's flights only in one unit: the flights'
    IR files must state the same (or all state none)."""
    units = {c.name: c.radiometry.units for c in caches}
    if len(set(units.values())) > 1:
        raise DataError(
            "data.radiometry: statistics puts every flight's temperatures on one scale, but the IR files "
            "state different units: "
            + ", ".join(f"{n} {u}" for n, u in units.items())
            + ". Convert the files to one unit (the units attribute of data.keys.ir_signal, with "
            "scale_factor and add_offset where they are packed), leave the odd flights out (data.flights), "
            "or set data.radiometry: none."
        )


def flag_range(cfg: Config) -> tuple[float, float] | None:
    """The label range the cloud flag compares with (data.cloud_flag base_in_range); None: any CPL layer."""
    d = cfg.data
    return (float(d.cbh_min_km), float(d.cbh_max_km)) if d.cloud_flag == "base_in_range" else None


class CloudDataset(Dataset):
    """The samples of some flights; item i -> frames (T, H, W), scalars (3,), target (standardised height,
    0 where none), has_height (1/0), cloud (the cloud flag: 1 cloud, 0 none), weight, index.

    `cloud`: also the samples with a cloud flag but no height (clear sky, cloud outside the label range),
    for a model with a cloud output; without it only the samples with a height. `flags`: the label range
    the cloud flag compares with (data.cloud_flag base_in_range: 1 where a cloud base lies in it), None:
    any CPL layer is cloud. The constructor's nine parameters are the flights, their scalers and seven
    settings, each a plain value of the data config or the run (passed one by one so that the data layer
    needs no Config, and every one has a default)."""

    def __init__(
        self,
        caches: list[FlightCache],
        scalers: Scalers,
        augment: bool = False,
        seed: int = 0,
        flight_weights: dict[str, float] | None = None,
        sun_azimuth: str = "relative",
        along_track_axis: str = "rows",
        cloud: bool = True,
        flags: tuple[float, float] | None = None,
    ):
        self.caches, self.scalers, self.augment, self.seed = caches, scalers, augment, seed
        self.flags = flags
        self.flight_table = ""  # the training set's: each flight's files and filters, as a table (below)
        # per flight: the cloud class of each sample (cpl.cloud_classes; 0/1 for any CPL layer) and the flag
        self.classes = [
            c.cloud.astype(np.int8) if flags is None else cloud_classes(c.layer_base_km, c.cloud, *flags)
            for c in caches
        ]
        self.flag_of = [
            (k == 1 if flags is None else k == BASE_IN_RANGE).astype(np.int8) for k in self.classes
        ]
        self.azimuth = [model_azimuth(c.saa_deg, c.heading_deg, sun_azimuth) for c in caches]
        # no flip where the azimuth is unknown either: a filled-in mean mirrored is no angle of this image
        self.mirror = [
            np.where(np.isfinite(a), mirror_line(c.heading_deg, sun_azimuth, along_track_axis), np.nan)
            for a, c in zip(self.azimuth, caches)
        ]
        rows = [np.arange(len(c)) if cloud else np.flatnonzero(c.has_height) for c in caches]
        self.flight_of = np.repeat(np.arange(len(caches)), [len(r) for r in rows])
        self.local = np.concatenate(rows) if rows else np.zeros(0, int)
        weights = flight_weights or {}
        self.weight_of = [float(weights.get(c.name, 1.0)) for c in caches]
        self.epoch = 0
        nan = sum(
            int((~np.isfinite(c.sza_deg)).sum() + (~np.isfinite(a)).sum())
            for c, a in zip(caches, self.azimuth)
        )
        if nan:
            log.info(
                "%d missing solar angles in %s: a zenith angle is filled with the training mean, an azimuth "
                "has no direction (sine and cosine 0)",
                nan,
                ", ".join(c.name for c in caches),
            )
        no_flip = {c.name: int((~np.isfinite(m)).sum()) for c, m in zip(caches, self.mirror)}
        if augment and any(no_flip.values()):
            log.info(
                "never flipped (no heading or no azimuth): %s",
                ", ".join(f"{n} {k} of {len(c)}" for (n, k), c in zip(no_flip.items(), caches) if k),
            )

    def __len__(self) -> int:
        return len(self.flight_of)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _per_sample(self, attr: str) -> np.ndarray:
        if not len(self):
            return np.zeros(0)
        return np.concatenate([getattr(c, attr) for c in self.caches])[self._global()]

    def _global(self) -> np.ndarray:
        starts = np.cumsum([0] + [len(c) for c in self.caches])[:-1]
        return starts[self.flight_of] + self.local

    def targets_km(self) -> np.ndarray:
        """Height per sample (km), NaN where the sample has only a cloud flag."""
        return self._per_sample("cbh_km").astype(np.float64)

    def has_height(self) -> np.ndarray:
        return np.isfinite(self.targets_km())

    def cloud_flags(self) -> np.ndarray:
        """The cloud flag per sample (1 cloud, 0 none), by the dataset's `flags` definition."""
        return self._per_flight(self.flag_of).astype(np.int64)

    def cloud_classes(self) -> np.ndarray:
        """The cloud class per sample (cpl.cloud_classes; 0/1 where any CPL layer is cloud)."""
        return self._per_flight(self.classes).astype(np.int64)

    def _per_flight(self, arrays: list[np.ndarray]) -> np.ndarray:
        if not len(self):
            return np.zeros(0)
        return np.concatenate(arrays)[self._global()]

    def frame_indices(self) -> np.ndarray:
        """The IR frame of each sample (its time order within its flight)."""
        return self._per_sample("frame_index").astype(np.int64)

    def sza_deg(self) -> np.ndarray:
        """Each sample's solar zenith angle (degrees, NaN where unknown)."""
        return self._per_sample("sza_deg").astype(np.float64)

    def azimuth_deg(self) -> np.ndarray:
        """Each sample's sun azimuth as the network sees it (model_azimuth; NaN where unknown)."""
        return self._per_flight(self.azimuth).astype(np.float64)

    def frame_p10(self) -> np.ndarray:
        return self._per_sample("frame_p10").astype(np.float64)

    def frame_stats(self) -> np.ndarray:
        """(N, K) each sample's labelled frame's radiometric statistics (preprocess.STAT_NAMES), raw."""
        if not len(self):
            return np.zeros((0, len(STAT_NAMES)))
        return np.concatenate([c.frame_stats for c in self.caches])[self._global()].astype(np.float64)

    def atmosphere(self) -> tuple[np.ndarray, tuple[str, ...]]:
        """((N, P) each sample's atmosphere predictors as read (data/predictors.py; NaN where unknown), their
        names); (N, 0) and () where the flights' predictors were not read."""
        if not self.caches or any(c.atmosphere is None for c in self.caches):
            return np.zeros((len(self), 0)), ()
        names = self.caches[0].atmosphere_names
        if any(c.atmosphere_names != names for c in self.caches):
            return np.zeros((len(self), 0)), ()
        if not len(self):
            return np.zeros((0, len(names))), names
        return np.concatenate([c.atmosphere for c in self.caches])[self._global()].astype(np.float64), names

    def angles(self) -> np.ndarray:
        """(N, 3) the angle inputs as the network sees them (without augmentation)."""
        return self.inputs(np.arange(len(self)))[0][:, :ANGLE_INPUTS]

    def flight_names(self) -> np.ndarray:
        return np.array([c.name for c in self.caches] or [""])[self.flight_of]

    def identity(self, i: int) -> tuple[str, int]:
        """(flight name, IR frame index) of sample i."""
        c = self.caches[self.flight_of[i]]
        return c.name, int(c.frame_index[self.local[i]])

    def inputs(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(angles (N, 3), standardised targets (N,), 0 where a sample has no height) of samples `indices`, as
        __getitem__ gives them without augmentation, but without reading their frames."""
        indices = np.asarray(indices, np.int64)
        s = self.scalers
        width = ANGLE_INPUTS + (len(STAT_NAMES) if s.radiometry else 0) + s.n_atmosphere
        scalars, targets = np.zeros((len(indices), width), np.float32), np.zeros(len(indices), np.float32)
        for k, c in enumerate(self.caches):
            mine = self.flight_of[indices] == k
            j = self.local[indices[mine]]
            scalars[mine] = scalar_inputs(c.sza_deg[j], self.azimuth[k][j], s, c.frame_stats[j], _rows(c, j))
            height = c.cbh_km[j].astype(np.float64)
            targets[mine] = np.where(np.isfinite(height), (height - s.cbh_mean) / s.cbh_std, 0.0)
        return scalars, targets

    def __getitem__(self, i: int) -> dict:
        k, j, s = self.flight_of[i], self.local[i], self.scalers
        c = self.caches[k]
        frames = torch.from_numpy(c.frames.read(c.windows[j]).astype(np.float32))  # (T, H, W)
        azimuth = float(self.azimuth[k][j])
        if self.augment:
            line = float(self.mirror[k][j])
            frames, azimuth = augment_sample(
                frames,
                azimuth,
                np.random.default_rng([self.seed, self.epoch, int(i)]),
                line if np.isfinite(line) else None,
            )
        scalars = scalar_inputs(c.sza_deg[j], azimuth, s, c.frame_stats[j : j + 1], _rows(c, [j]))
        scalars = torch.from_numpy(scalars[0])
        height = float(c.cbh_km[j])
        has = np.isfinite(height)
        target = torch.tensor((height - s.cbh_mean) / s.cbh_std if has else 0.0, dtype=torch.float32)
        weight = torch.tensor(self.weight_of[self.flight_of[i]], dtype=torch.float32)
        return {
            "frames": frames,
            "scalars": scalars,
            "target": target,
            "has_height": torch.tensor(float(has)),
            "cloud": torch.tensor(float(self.flag_of[k][j])),
            "weight": weight,
            "index": int(i),
        }


def _rows(cache: FlightCache, rows) -> np.ndarray | None:
    """The cache's atmosphere predictors at `rows`, or None where it has none."""
    return None if cache.atmosphere is None else cache.atmosphere[np.asarray(rows, np.int64)]


@dataclass
class RunData:
    """A run's data by role (splits.py): the samples trained on (`train_set`, augmented, with the flight table
    the trainer logs), the validation samples (`val_set`), the test flights (`test_set`), the split that
    made them, and every flight's whole cache (`caches`: the run's fingerprint)."""

    train_set: CloudDataset
    val_set: CloudDataset
    test_set: CloudDataset
    split: Split
    caches: list[FlightCache]


def prepare_data(cfg: Config, skipped: list[FoundFlight] = (), backend: Backend | None = None) -> RunData:
    """Caches of all (resolved) flights, split by role, scalers fitted on the part trained on only. The
    training set carries `flight_table`: each flight's files, frames, labels kept and removed by each filter
    (the trainer logs it once the run's log file exists)."""
    caches = predictors.attach(load_caches(cfg.data, backend), cfg.data)
    notes = Notes()
    table = format_table(summary_rows(cfg.data, caches, list(skipped), notes))
    table += ("\n" + notes.text()) if notes else ""
    return split_data(cfg, caches, table)


def check_heights(caches: list[FlightCache], test_flights: list[str]) -> None:
    """Every flight has a height label, but a test flight (high cloud alone, say: scored for its cloud flag,
    said in the log); a DataError names the others."""
    empty = [c.name for c in caches if not c.has_height.any()]
    tested = [n for n in empty if n in test_flights]
    if tested:  # a test flight of high cloud alone, say: scored for its cloud flag
        log.warning(
            "test flight(s) %s: no height label in the product's range; scored for the cloud flag alone",
            ", ".join(tested),
        )
    if len(tested) < len(empty):
        raise DataError(
            f"flights with no usable height label: {', '.join(n for n in empty if n not in tested)}; see the "
            "counts in the log, and the data.cbh_* / match_tolerance_s filters. A flight without one can "
            "only be a test flight (data.test_flights), scored for its cloud flag alone"
        )


def split_data(cfg: Config, caches: list[FlightCache], table: str = "") -> RunData:
    """prepare_data's datasets from the flights' caches: split by role, scalers fitted on the part trained on
    (also for a resumed run that keeps an earlier release's reading of its data)."""
    check_heights(caches, cfg.data.test_flights)
    split = choose_split(caches, cfg.data)
    fit, val, test = split.parts(caches)
    check_parts(fit, val, split)
    if cfg.data.radiometry != "none":
        check_radiometry(caches)
    scalers = fit_scalers(fit, cfg.data.radiometry, cfg.data.atmosphere)
    if scalers.atmosphere:
        log.info(
            "atmosphere: the network sees %d ERA5 predictors %s (data.atmosphere: %s), each standardised on "
            "the part trained on",
            scalers.n_atmosphere,
            "beside the frames"
            if cfg.data.atmosphere == "with_frames"
            else "and the sun's angles, no frames",
            cfg.data.atmosphere,
        )
    if scalers.radiometry:
        log.info(
            "radiometry: the network sees the labelled frame's brightness statistics in %s, on the scale "
            "(x - %.4g) / %.4g fitted on the part trained on (data.radiometry: statistics)",
            fit[0].radiometry.words(),
            scalers.radiometry_offset,
            scalers.radiometry_scale,
        )
    weights = {cfg.data.overweight_flight: cfg.data.overweight_factor} if cfg.data.overweight_flight else {}
    log.info(
        "training on %s (%d samples); %s; test flights: %s (%d samples), scored once, at the end",
        ", ".join(f"{c.name}{'' if len(c) == n else ' (part)'}" for c, n in zip(fit, _whole(fit, caches))),
        sum(map(len, fit)),
        split.words(),
        ", ".join(c.name for c in test),
        sum(map(len, test)),
    )
    # the frames with only a cloud flag: trained on by a joint model; a probe is fitted on them after training
    # (science/finish.py), and both are scored on them
    mode, flags = cfg.model.cloud_head, flag_range(cfg)
    train_set = CloudDataset(
        fit,
        scalers,
        augment=cfg.data.augment,
        seed=cfg.train.seed,
        flight_weights=weights,
        sun_azimuth=cfg.data.sun_azimuth,
        along_track_axis=cfg.data.along_track_axis,
        cloud=mode == "joint",
        flags=flags,
    )
    train_set.flight_table = table
    scored = dict(sun_azimuth=cfg.data.sun_azimuth, cloud=mode != "none", flags=flags)
    return RunData(
        train_set, CloudDataset(val, scalers, **scored), CloudDataset(test, scalers, **scored), split, caches
    )


def _whole(parts: list[FlightCache], caches: list[FlightCache]) -> list[int]:
    """The sample count of each part's whole flight."""
    sizes = {c.name: len(c) for c in caches}
    return [sizes[p.name] for p in parts]


def augment_sample(
    frames: torch.Tensor, azimuth: float, rng: np.random.Generator, mirror_deg: float | None
) -> tuple[torch.Tensor, float]:
    """Flip, jitter and erase one (T, H, W) float sample; the same change applies to all T frames.
    The flip mirrors the columns and the azimuth across the line at `mirror_deg` (mirror_line); None: no
    flip (the random draw is made all the same, so the other changes do not depend on it)."""
    if rng.random() < FLIP_PROB and mirror_deg is not None:
        frames = frames.flip(-1)
        azimuth = (2.0 * mirror_deg - azimuth) % 360.0
    contrast = 1.0 + rng.uniform(-CONTRAST, CONTRAST)
    brightness = rng.uniform(-BRIGHTNESS, BRIGHTNESS)
    frames = frames * contrast + brightness
    if rng.random() < ERASE_PROB:
        _, h, w = frames.shape
        area = rng.uniform(0.02, 0.1) * h * w
        aspect = np.exp(rng.uniform(np.log(0.5), np.log(2.0)))
        eh, ew = (
            min(h, max(1, int(round((area * aspect) ** 0.5)))),
            min(w, max(1, int(round((area / aspect) ** 0.5)))),
        )
        top, left = int(rng.integers(0, h - eh + 1)), int(rng.integers(0, w - ew + 1))
        frames = frames.clone()
        frames[:, top : top + eh, left : left + ew] = 0.0  # 0 is the z-scored frame mean
    return frames, azimuth


def quick_subset(n: int, fraction: float) -> np.ndarray:
    """The same evenly spaced sample indices every epoch (at least one)."""
    k = max(1, min(n, int(round(n * fraction))))
    return np.unique(np.linspace(0, n - 1, k).round().astype(np.int64))


def part_slice(n: int, rank: int, world: int) -> slice:
    """Process `rank`'s contiguous part of n items split over `world` (the first n % world take one more)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return slice(lo, lo + base + (rank < extra))


class EpochBatchSampler:
    """Batches of one epoch from a permutation that depends only on (seed, epoch).

    A last batch smaller than `min_last` samples (2, or the number of processes) is merged into
    the one before it: BatchNorm statistics of one sample are meaningless, and every process
    needs a sample. `start_batch` skips batches already trained on, at no cost.
    With several processes each batch is the global batch and this process yields its own
    contiguous part (`rank` of `world`); the order does not depend on how many processes there are.
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, shuffle: bool = True, rank: int = 0, world: int = 1
    ):
        self.n, self.batch_size, self.seed, self.shuffle = n, batch_size, seed, shuffle
        self.rank, self.world, self.min_last = rank, world, max(2, world)
        self.epoch, self.start_batch = 0, 0

    def batches(self, epoch: int) -> list[np.ndarray]:
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(self.n)
            if self.shuffle
            else np.arange(self.n)
        )
        out = [order[i : i + self.batch_size] for i in range(0, self.n, self.batch_size)]
        if len(out) > 1 and len(out[-1]) < self.min_last:
            last = out.pop()
            out[-1] = np.concatenate([out[-1], last])
        return out

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self):
        for b in self.batches(self.epoch)[self.start_batch :]:
            yield b[part_slice(len(b), self.rank, self.world)].tolist()

    def batches_per_epoch(self) -> int:
        count = -(-self.n // self.batch_size)
        last = self.n - (count - 1) * self.batch_size
        return count - 1 if count > 1 and last < self.min_last else count

    def samples_before(self, batch: int) -> int:
        """How many samples of the epoch the first `batch` batches hold (the resume position in samples)."""
        return self.n if batch >= self.batches_per_epoch() else batch * self.batch_size

    def __len__(self) -> int:
        return max(0, self.batches_per_epoch() - self.start_batch)
