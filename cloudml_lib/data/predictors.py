"""The atmosphere's predictors of a run's flights: ERA5 found beside each flight, read, and interpolated to
each labelled frame (era5.py, atmosphere.py).

`data.atmosphere` chooses what the network sees of them (config.py ATMOSPHERE): `none` (the frames and the sun
alone, as every run before the setting), `with_frames` (the predictors beside the frames) or `alone` (the
predictors and the sun's angles, no frames). The predictors a run uses are those every one of its flights'
files allows (era5.PREDICTORS, in that order); the scalers (dataset.py) standardise each on the part of the
training flights trained on, and a trained model asks for the same names wherever it is evaluated or
predicts.

A run whose flights have no ERA5 file at all trains on the frames (`with_frames`), saying so in one line;
`alone` then stops with what to do. Flights of which only some have files stop the run with their names: the
network cannot read the atmosphere of some flights and not of others.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from cloudml_lib.base.config import DataConfig, FlightConfig
from cloudml_lib.base.errors import DataError
from cloudml_lib.data import era5

log = logging.getLogger(__name__)

FETCH_HINT = (
    "`python -m cloudml_lib fetch-era5 --config YOUR.yaml` downloads them from the Copernicus Climate Data "
    "Store (docs/how-to/era5.md)"
)


# The smallest spread a predictor is scaled by, per unit (era5.PREDICTORS): about a reanalysis' error at a
# point (0.5 K of temperature, 50 m of height, 0.05 of a fraction, 1 kg m-2 of water vapour, 0.5 m/s of wind;
# data/demo_era5.py ERRORS gives the published figures behind them)
SPREAD_FLOOR = {"K": 0.5, "m": 50.0, "1": 0.05, "kg m-2": 1.0, "m s-1": 0.5}


def spread_floor(name: str) -> float:
    """The smallest spread predictor `name` is scaled by (SPREAD_FLOOR of its unit)."""
    return SPREAD_FLOOR[era5.PREDICTORS[name][0]]


def flight_files(flight: FlightConfig, data: DataConfig) -> list[Path]:
    """`flight`'s ERA5 files: in its folder, else a campaign's between it and data.dir (era5.find_files)."""
    folder = (Path(data.dir) / flight.ir_file).parent
    return era5.find_files(Path(data.dir), folder) if folder.is_dir() else []


def frames_atmosphere(
    flight: FlightConfig, data: DataConfig, t, lat, lon, names: list[str], found: era5.Era5 | None = None
) -> np.ndarray:
    """(N, P) the predictors `names` at frames of `flight` at times `t` (epoch seconds) and positions
    (degrees), from `found` (its files read; None: read here): NaN where a frame's time or position is
    unknown; a frame outside the files' hours or box is refused by name (era5.interpolate)."""
    if found is None:
        files = flight_files(flight, data)
        if not files:
            folder = (Path(data.dir) / flight.ir_file).parent
            raise DataError(
                f"flight {flight.name}: no ERA5 file lies beside it in {folder}, and this model reads the "
                f"atmosphere ({', '.join(names)}). {FETCH_HINT} (--flights {flight.name})"
            )
        found = era5.read_files(files)
    ok, lacking = era5.available_predictors(found)
    missing = [n for n in names if n not in ok]
    if missing:
        raise DataError(
            f"flight {flight.name}: its ERA5 files ({', '.join(p.name for p in found.files)}) lack what the "
            "predictors "
            + "; ".join(f"{n} need ({lacking.get(n, 'unknown')})" for n in missing)
            + f". Fetch them again with the variables they need: {FETCH_HINT}"
        )
    values = era5.predictors_at(found, t, lat, lon, flight.name, names)
    out = np.stack([np.asarray(values[n], np.float64) for n in names], axis=1).reshape(-1, len(names))
    known = np.isfinite(np.asarray(t, np.float64)) & np.isfinite(np.asarray(lat, np.float64))
    known &= np.isfinite(np.asarray(lon, np.float64))
    gaps = known[:, None] & ~np.isfinite(out)
    if gaps.any():  # a missing value of the file's, never taken for a frame without a position
        k = int(np.flatnonzero(gaps.any(axis=0))[0])
        files = ", ".join(p.name for p in found.files)
        first = int(np.flatnonzero(gaps[:, k])[0])
        raise DataError(
            f"flight {flight.name}: its ERA5 files ({files}) hold no value of {names[k]} "
            f"({era5.PREDICTORS[names[k]][2]}) at {int(gaps[:, k].sum())} frame(s) with a known time and "
            f"position (e.g. frame {first}): missing values (NaN, a land point's sea temperature) where the "
            "flight is. Delete the files and fetch them again, or leave the flight out (data.flights)"
        )
    return out


def attach(caches: list, data: DataConfig, names: list[str] | None = None) -> list:
    """`caches` (data/cache.py FlightCache) with each labelled frame's predictors (`atmosphere`, (N, P), and
    `atmosphere_names`), as data.atmosphere asks: unchanged with `none`. `names`: the predictors a trained
    model reads (its scalers'); None: every one all the flights' files allow. No flight with files: the
    caches as they are, with one line saying what the run could use (`with_frames`), or DataError (`alone`,
    or a model that reads the atmosphere)."""
    if data.atmosphere == "none" and names is None:
        return caches
    by_name = {f.name: f for f in data.flights}
    files = {c.name: flight_files(by_name[c.name], data) if c.name in by_name else [] for c in caches}
    have = [n for n, f in files.items() if f]
    lacking = [n for n, f in files.items() if not f]
    if lacking and names is not None:
        raise DataError(
            f"this model reads the atmosphere of each flight it scores ({', '.join(names)}), but no ERA5 "
            f"file lies beside {', '.join(lacking)} in {data.dir}: {FETCH_HINT} (--flights "
            f"{' '.join(lacking)}); the model cannot score a flight without its atmosphere"
        )
    if not have:
        if data.atmosphere == "with_frames":
            log.info(
                "data.atmosphere: with_frames, but no ERA5 file lies beside the flights (%s): the network "
                "sees the frames and the sun alone; %s",
                ", ".join(files),
                FETCH_HINT,
            )
            return caches
        raise DataError(
            f"data.atmosphere: {data.atmosphere} needs the atmosphere of each flight, but no ERA5 file lies "
            f"beside the flights ({', '.join(files)}) in {data.dir}: {FETCH_HINT}, or set "
            "data.atmosphere: none"
        )
    if lacking:
        raise DataError(
            f"data.atmosphere: ERA5 files lie beside flights {', '.join(have)} but not {', '.join(lacking)}: "
            f"the network must read every flight's atmosphere or none. {FETCH_HINT} (--flights "
            f"{' '.join(lacking)}), or leave those flights out (data.flights), or set data.atmosphere: none"
        )
    found = {n: era5.read_files(f) for n, f in files.items()}  # each flight's files read once
    if names is None:
        allowed = [set(era5.available_predictors(f)[0]) for f in found.values()]
        names = [n for n in era5.PREDICTORS if all(n in a for a in allowed)]
        if not names:
            raise DataError(
                "data.atmosphere: the flights' ERA5 files have no predictor in common "
                f"({', '.join(era5.PREDICTORS)} each need variables named in docs/how-to/era5.md)"
            )
    from cloudml_lib.data.era5_requests import flight_track

    out = []
    for c in caches:
        flight = by_name[c.name]
        t, lat, lon = flight_track(flight, data)
        rows = np.asarray(c.frame_index, np.int64)
        values = frames_atmosphere(flight, data, t[rows], lat[rows], lon[rows], names, found[c.name])
        out.append(replace(c, atmosphere=values, atmosphere_names=tuple(names)))
    unknown = sum(int((~np.isfinite(c.atmosphere).all(axis=1)).sum()) for c in out)
    log.info(
        "atmosphere: %d predictor(s) from ERA5 at each labelled frame of %d flight(s) (%s)%s",
        len(names),
        len(out),
        ", ".join(names),
        f"; {unknown} frame(s) without a position or time take the training mean" if unknown else "",
    )
    return out


def for_baselines(caches: list, data: DataConfig) -> tuple[list, str | None]:
    """`caches` with every predictor all their flights' ERA5 files allow, whatever data.atmosphere says: the
    baselines that know the atmosphere (science/baselines.py) read it even where the network does not.
    Caches that carry predictors already (a network that reads them) are kept. Without the atmosphere of
    every flight: the caches unchanged and the reason, in words."""
    names = {c.atmosphere_names for c in caches if c.atmosphere is not None}
    if caches and len(names) == 1 and all(c.atmosphere is not None for c in caches):
        return caches, None
    by_name = {f.name: f for f in data.flights}
    lacking = sorted(
        {c.name for c in caches if c.name not in by_name or not flight_files(by_name[c.name], data)}
    )
    if lacking:
        return caches, f"no ERA5 file lies beside flight(s) {', '.join(lacking)}; {FETCH_HINT}"
    try:
        return attach(caches, replace(data, atmosphere="with_frames")), None
    except DataError as e:
        return caches, str(e)
