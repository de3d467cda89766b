"""Cloud base height along whole flights: the science product, not only where the lidar measured.

`predict_flights` applies a run's best model to every frame of a flight that has a full window
(T frames centred on it, shifted inside the flight at its ends) and a usable time. Frames are
streamed from the IR file in blocks and preprocessed exactly as for training (then rounded to
float16, as the cache stores them) by worker processes (data/preprocess.py) that prepare the next
blocks while the network runs. Each frame is encoded once, not once for each of the T windows it
sits in (inference.py: the same numbers, T times less encoder work), and only its encoding (C
numbers) is kept, so host memory stays flat whatever the flight's length. A
flight needs only its IR file: the nav file gives position and sun angles (filled with the training
mean where absent), the CPL file the lidar label where one exists.

With a cloud output the model also gives each frame the probability of its cloud flag (data.cloud_flag: a
cloud base in the height product's range, or any CPL layer for runs made before that setting) and, for the
former, the class of what else it sees (clear sky, high cloud alone, a base below the range); the flag
(probability at or above model.cloud_threshold) decides where a height is given: only where a cloud base in
the range is flagged. `--cloud-flag bt_threshold` writes the brightness-temperature baseline's flag instead
(clouds.bt_flag, fitted on the training flights), for when the evaluation's verdict says it beats the model;
each file says which flag it holds. A height outside the span of the labels the model was fitted on (best.pt;
runs made before it recorded one: data.cbh_min_km to data.cbh_max_km) is an extrapolation, flagged in
cloud_base_height_qc. Each file carries its model's test skill and verdict (evaluation.json), the flight's
role in the run (test, validation, trained on, or none) and whether the intervals were calibrated on it.
A height that cannot be a cloud base is never given as one: below the surface (0 km), or above the aircraft
where the nav file gives its altitude, else above data.cbh_max_km (config.height_bounds_km). A model with
model.height_head bounded cannot answer one; a run made before that setting can, and such heights are masked
(missing), flagged in cloud_base_height_qc, counted, and said in the files' attributes. With a calibration
(`intervals.json` of the run, or of a cross-validation via `--calibration`), each height gets a prediction
interval (`intervals.py`), cut to the same bounds.

Per flight: `<name>_cbh.nc` (NetCDF-4, CF-1.8: time, lat, lon, cloud_probability, cloud_flag,
cloud_base_height with its lower and upper bounds, the CPL label and cloud flag), `<name>_cbh.csv`,
and two plots: CBH along the flight (the interval shaded, clear sky greyed, CPL labels as points)
and the track coloured by predicted CBH.
"""

from __future__ import annotations

import json
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from cloudml_lib.base.config import LEGACY_VALIDATION, DataConfig, FlightConfig, height_bounds_km
from cloudml_lib.base.errors import CloudMLError, DataError
from cloudml_lib.base.outputs import write_text
from cloudml_lib.base.ownership import Kind, claim
from cloudml_lib.base.resources import package_version
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.network.inference import StreamEncoder, eval_batch_size, windows_forward
from cloudml_lib.core.network.metrics import Scored
from cloudml_lib.core.run.checkpoint import Key, weights_sha256
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.provenance import trained_backend
from cloudml_lib.data import cpl, er2, navigation
from cloudml_lib.data.cache import cache_root
from cloudml_lib.data.dataset import Scalers, model_azimuth, scalar_inputs
from cloudml_lib.data.domain import Domain, inputs_of, recorded
from cloudml_lib.data.flights import find_flights
from cloudml_lib.data.hashing import input_files
from cloudml_lib.data.hdf5 import holds_dataset
from cloudml_lib.data.predictors import frames_atmosphere
from cloudml_lib.data.preprocess import (
    SKIMAGE,
    STAT_NAMES,
    Backend,
    FramePool,
    FrameSpec,
    file_radiometry,
    resolve_backend,
    resolve_workers,
)
from cloudml_lib.science import intervals, plots, products
from cloudml_lib.science.evaluate import load_run_model
from cloudml_lib.science.flagging import (
    Flagging,
    choose_flagging,
    cloud_and_intervals,
    flag_unseen,
    learned_range,
)
from cloudml_lib.science.flightfile import (
    flight_dataset,
    flight_figures,
    spread_words,
    write_csv,
    write_netcdf,
)
from cloudml_lib.science.report import write_report

log = logging.getLogger(__name__)

BLOCK = 256  # frames preprocessed at a time (the pool prepares the next blocks while these are encoded)


def _flight_inputs(flight: FlightConfig, data: DataConfig) -> dict:
    """Frame times, angles, position and CPL labels per frame (NaN where unknown); IR required only."""
    root = Path(data.dir)
    ir = root / flight.ir_file
    frame_t, n_frames, _, _ = er2.read_ir_times(ir, flight, data)
    out = {
        "t": frame_t,
        **{
            k: np.full(n_frames, np.nan)
            for k in ("sza", "saa", "heading", "lat", "lon", "label", "cpl_cloud", "altitude_km")
        },
    }
    has_nav = bool(flight.nav_file) and (root / flight.nav_file).is_file()
    nav_ok = has_nav and _use_nav(flight, data, root / flight.nav_file, frame_t, out)
    if not has_nav:
        log.warning(
            "flight %s: no nav file: sun angles are the training mean, and there is no position", flight.name
        )
    if flight.cpl_file and (root / flight.cpl_file).is_file():
        try:
            # without a usable nav file the labels are read with the CPL file's own angles (not needed here)
            labels = cpl.read_flight_labels(
                flight, data if nav_ok else DataConfig(**{**vars(data), "angles_source": "cpl"})
            )
            out["label"][labels.frame_index] = labels.cbh_km
            out["cpl_cloud"][labels.frame_index] = (
                labels.cloud
                if data.cloud_flag != "base_in_range"
                else cpl.cloud_classes(labels.layer_base_km, labels.cloud, data.cbh_min_km, data.cbh_max_km)
            )
        except DataError as e:
            log.warning(
                "flight %s: no CPL labels to compare with (%s)", flight.name, str(e).split(": ", 1)[-1]
            )
    return out


def _use_nav(flight: FlightConfig, data: DataConfig, path: Path, frame_t: np.ndarray, out: dict) -> bool:
    """Put the nav file's sun angles, heading and position per frame into `out`. False, with a warning naming
    the flight, when the file is not usable or too few frames found a record in it (data.min_nav_match): a
    frame without a record gets the training mean zenith and no sun direction, never another record's."""
    try:
        nav = navigation.read_nav(flight, data, path, frame_t)
    except DataError as e:
        log.warning(
            "flight %s: the nav file is not usable (%s); predicting without it: sun angles are the training "
            "mean, and there is no position",
            flight.name,
            str(e).split(": ", 1)[-1],
        )
        return False
    out.update({k: nav.values[k] for k in ("sza", "saa", "heading", "lat", "lon")})
    if nav.values.get("altitude") is not None:
        out["altitude_km"] = _altitude_km(nav.values["altitude"], flight.name, path)
    problem = navigation.nav_match_problem(nav, flight, data, path)
    if problem:
        log.warning("%s Predicting anyway, with the nav records that were found.", problem)
    elif data.sun_azimuth == "relative" and not np.isfinite(out["heading"]).any():
        log.warning(
            "flight %s: %s: the sun azimuth relative to it is unknown (no direction)",
            flight.name,
            nav.heading_note,
        )
    return problem is None


# An ER-2 cruises near 20,000 m; a median altitude below this is not in metres (feet, km) or not in flight.
MIN_CRUISE_ALTITUDE_M = 1000.0


def _altitude_km(altitude_m: np.ndarray, name: str, path: Path) -> np.ndarray:
    """The aircraft's altitude per frame in km from the nav file's metres (NaN where unknown): the ceiling of
    a cloud base. Not used, with a warning, when the numbers do not look like an ER-2's altitude in metres."""
    if not np.isfinite(altitude_m).any():
        return np.full(altitude_m.size, np.nan)
    median = float(np.nanmedian(altitude_m))
    if median < MIN_CRUISE_ALTITUDE_M:
        log.warning(
            "flight %s: the aircraft altitude in %s has a median of %.4g, not an altitude in metres "
            "(data.keys.nav_altitude or ict_altitude, metres): it is not used; heights are bounded by "
            "data.cbh_max_km",
            name,
            path.name,
            median,
        )
        return np.full(altitude_m.size, np.nan)
    return np.asarray(altitude_m, np.float64) / 1000.0


@dataclass
class FlightPredictor:
    """A trained model ready for whole flights: on its device with its autocast, the run's scalers, how many
    frames it encodes at a time, and how the frames are read and preprocessed (the CLAHE backend and the
    worker processes; none: this process)."""

    model: torch.nn.Module
    scalers: Scalers
    device: torch.device
    batch_size: int
    autocast: object = nullcontext
    backend: Backend = SKIMAGE
    pool: FramePool | None = None
    domain: Domain | None = None  # the training samples' inputs (data/domain.py); None: cannot check
    unchecked: str = ""  # why not


def predict_flight(predictor: FlightPredictor, flight: FlightConfig, data: DataConfig) -> dict:
    """Predicted CBH (km) for every frame with a usable time; arrays over those frames.

    Every frame is encoded once (inference.py), `batch_size` frames at a time, as its block arrives from
    the predictor's pool (worker processes; none: this process), which prepares the next blocks meanwhile;
    then each frame's window (T frames centred on it, shifted inside the flight at its ends) goes through the
    head. Host memory holds one block of frames and C numbers per frame. The data checks of training apply: a
    blank frame (no finite pixel, or no contrast) gets no height (NaN), non-finite pixels are filled with
    the frame's median; both are counted in `counts`."""
    model, scalers, device, autocast = (
        predictor.model,
        predictor.scalers,
        predictor.device,
        predictor.autocast,
    )
    inputs = _flight_inputs(flight, data)
    n, t = inputs["t"].size, data.temporal_frames
    if n < t:
        raise DataError(f"flight {flight.name}: {n} frames, fewer than data.temporal_frames={t}")
    spec, path = FrameSpec.of(data), Path(data.dir) / flight.ir_file
    if scalers.radiometry:  # the model reads brightness statistics: in the units it was trained on
        scalers.check_units(
            file_radiometry(path, data.keys.ir_signal, flight.name).units, f"flight {flight.name}"
        )
    encodings, blank, filled, p10, stats = encode_flight(
        model,
        (predictor.pool or FramePool(0)).blocks(
            path, data.keys.ir_signal, flight.name, np.arange(n), spec, predictor.backend, ahead=BLOCK
        ),
        n,
        flight.name,
        StreamEncoder(model, device, predictor.batch_size, autocast),
    )
    azimuth = model_azimuth(inputs["saa"], inputs["heading"], data.sun_azimuth)
    atmosphere = scalers.atmosphere and frames_atmosphere(  # a model that reads it: at every frame
        flight, data, inputs["t"], inputs["lat"], inputs["lon"], scalers.atmosphere
    )
    scalars = scalar_inputs(inputs["sza"], azimuth, scalers, stats, atmosphere)  # each window's centre's
    judged = predictor.domain and predictor.domain.judge(  # each frame's inputs against the training's
        inputs_of(inputs["sza"], azimuth, stats if scalers.radiometry else None, atmosphere)
    )
    first = np.clip(np.arange(n) - t // 2, 0, n - t)  # shift policy at the ends
    out = windows_forward(model, encodings, first[:, None] + np.arange(t)[None, :], scalars, device, autocast)
    scored = Scored.from_outputs(
        {k: None if v is None else v.astype(np.float64) for k, v in out.items()}, scalers
    )
    pred = scored.height_km
    prob = np.full(n, np.nan) if scored.cloud_prob is None else scored.cloud_prob
    classes = scored.class_prob
    pred[blank] = prob[blank] = p10[blank] = np.nan  # no image, no answer (as training drops such labels)
    keep = np.isfinite(inputs["t"])
    counts = {
        "frames": int(n),
        "no_time": int((~keep).sum()),
        "blank": int((blank & keep).sum()),
        "filled_pixels": int(filled),
        "predicted": int((keep & ~blank).sum()),
    }
    _say_counts(flight.name, counts)
    out = {k: v[keep] for k, v in inputs.items()} | {"cbh_km": pred[keep], "p10": p10[keep], "counts": counts}
    out["cloud_probability"] = prob[keep] if getattr(model, "cloud_output", False) else None
    out["class_probability"] = None if classes is None or out["cloud_probability"] is None else classes[keep]
    out["frame_index"] = np.flatnonzero(keep)
    if judged is not None:  # the domain check, over the same frames
        out["input_distance"] = np.where(blank, np.nan, judged.distance)[keep]
        out["inputs_outside"], out["judged"] = judged.outside[keep] & ~blank[keep], judged.subset(keep)
    return out


def encode_flight(
    model, stream, n: int, name: str, encode: StreamEncoder
) -> tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]:
    """(each frame's encoding (n, C), which frames are blank, the non-finite pixels filled, each raw frame's
    frame_p10 and radiometric statistics (n, K)) of a flight streamed in blocks: frames wait until a whole
    batch is there (the last one need not be whole)."""
    blank, filled, p10 = np.zeros(n, bool), 0, np.full(n, np.nan)
    stats = np.full((n, len(STAT_NAMES)), np.nan, np.float32)
    encodings = np.empty((n, model.feature_width), np.float32)  # (n, C): small, whatever n is
    bar = tqdm(total=n, desc=f"predict {name}", unit="frame")
    index, frames = np.zeros(0, np.int64), None  # frames received, not encoded yet (< one batch)
    try:
        done = 0
        while done < n:
            block = next(stream)
            blank[block.index], filled = block.blank, filled + int(block.filled.sum())
            p10[block.index], stats[block.index] = block.p10, block.stats
            index = np.concatenate([index, block.index])
            frames = block.frames if frames is None else np.concatenate([frames, block.frames])
            done += len(block.index)
            ready = len(index) if done >= n else len(index) // encode.batch * encode.batch  # whole batches
            if ready:
                encodings[index[:ready]] = encode(frames[:ready])
                index, frames = index[ready:], frames[ready:]
                bar.update(ready)
    finally:
        bar.close()
        stream.close()
    return encodings, blank, filled, p10, stats


def _say_counts(name: str, counts: dict) -> None:
    if counts["no_time"]:
        log.info("flight %s: %d frames without a usable time are left out", name, counts["no_time"])
    if counts["blank"]:
        log.warning(
            "flight %s: %d frames are blank (no finite pixel, or every pixel equal): no height for them "
            "(NaN in the files)%s",
            name,
            counts["blank"],
            "; more than 5% of the flight, check the IR file"
            if counts["blank"] > 0.05 * counts["frames"]
            else "",
        )
    if counts["filled_pixels"]:
        log.warning(
            "flight %s: %d non-finite pixels replaced by their frame's median, as in training",
            name,
            counts["filled_pixels"],
        )


def flights_to_predict(cfg, names: list[str]) -> dict[str, FlightConfig]:
    """The files of each flight to predict, with train's checks: the run's own entry (its files as
    trained), else the flight found in data.dir by its file names; only the IR file is required. Two
    candidate files of one role (two nav files, two copies of a flight folder) are refused, as in train."""
    from cloudml_lib.data.cache import cache_folders

    data = cfg.data
    root = Path(data.dir)
    skip = cache_folders(data)
    found = (
        {f.name: f for f in find_flights(DataConfig(**{**vars(data), "angles_source": "nav"}), skip)}
        if root.is_dir()
        else {}
    )
    listed = {f.name: f for f in data.flights}

    def here(n: str) -> bool:  # its IR file is in data.dir: as the run listed it, or found by name
        return (n in listed and (root / listed[n].ir_file).is_file()) or (
            n in found and "ir" in found[n].files
        )

    unknown = [n for n in names if not here(n)]
    if unknown:
        known = sorted(n for n in set(listed) | set(found) if here(n))
        raise CloudMLError(
            f"--flights: {', '.join(unknown)} not found: no IR file in {root} (flights there: "
            f"{', '.join(known) or 'none'}). Point --data-dir at the folder holding them, or name others "
            "with --flights."
        )
    out = {}
    for name in names:
        disc = found.get(name)
        several = [p for p in (disc.problems if disc else []) if p.startswith("several")]
        if several:
            raise DataError(
                f"flight {name}: {'; '.join(several)}. Predict uses the same files train would, so "
                "the choice must be unambiguous."
            )
        entry = listed.get(name)
        if entry is None or not (root / entry.ir_file).is_file():
            entry = disc.config()
        elif disc is not None:  # an optional file renamed or moved since training
            for role in ("cpl", "nav"):
                if not (root / getattr(entry, f"{role}_file")).is_file() and role in disc.files:
                    entry = FlightConfig(**{**vars(entry), f"{role}_file": disc.files[role]})
        out[name] = entry
    return out


def adopt_predictions(folder: Path) -> str | None:
    """Predictions of an earlier CloudML, proved by two files, never by one (a copied summary.json proved a
    user's folder CloudML's): the summary.json it wrote, and a flight's NetCDF it names that holds a cloud
    base height."""
    for flight in RunFiles(Path(folder)).predictions_summary():
        path = Path(folder) / f"{flight}_cbh.nc"
        if holds_dataset(path, "cloud_base_height"):
            return f"its summary.json reads and names {path.name}, a NetCDF of cloud base heights"
    return None


PREDICTIONS = Kind("predictions", "--out", adopt_predictions, "a folder of earlier predictions")


def predict_flights(
    run: RunFolder | str | Path,
    flights: list[str] | None = None,
    out_dir: str | Path | None = None,
    data_dir: str | None = None,
    calibration_dir: str | Path | None = None,
    cache_dir: str | None = None,
    cloud_flag: str = "model",
) -> list[Path]:
    """Predict whole flights with a run's best model; returns the NetCDF files written. `run`: the run's
    folder (a path is taken as one). `flights`: names from the run's config or found in data.dir (default:
    its test flights).
    `cloud_flag`: whose cloud flag the files hold: the model's, or bt_threshold (the brightness-temperature
    baseline fitted on the training flights, for a run whose verdict says it beats the model).
    `calibration_dir`: a folder whose intervals.json calibrates the intervals (a cross-validation's, whose
    leave-one-flight-out residuals show the error on a flight never seen); default the run's own.
    `cache_dir`: where the files' checksum memo goes if the run's recorded cache folder is not this
    machine's."""
    run = RunFolder.of(run)
    out = Path(out_dir) if out_dir else run.path / "predictions"
    job = _prepare(run, flights, data_dir, calibration_dir, cache_dir, cloud_flag, out)
    written = []
    with job.predictor() as predictor:
        for name in job.names:
            result = flight_result(predictor, job.rm, job.chosen[name], name, job.data, job.folder)
            written.append(_write_flight(result, name, job.folder))
    if out == run.path / "predictions":
        write_report(run)
    return written


def predict_datasets(
    run: RunFolder,
    flights: list[str] | None = None,
    data_dir: str | None = None,
    calibration_dir: str | Path | None = None,
    cache_dir: str | None = None,
    cloud_flag: str = "model",
) -> dict:
    """As predict_flights, but nothing is written: each flight's product as an xarray Dataset, read back from
    a NetCDF file written to a temporary folder, so that its variables, values and attributes are those of
    the file `predict` writes."""
    import tempfile

    import xarray as xr

    job = _prepare(run, flights, data_dir, calibration_dir, cache_dir, cloud_flag, None)
    datasets = {}
    with job.predictor() as predictor, tempfile.TemporaryDirectory(prefix="cloudml-predict-") as tmp:
        for name in job.names:
            result = flight_result(predictor, job.rm, job.chosen[name], name, job.data, job.folder)
            ds, encoding = flight_dataset(name, result, job.folder.run)
            nc = Path(tmp) / f"{name}_cbh.nc"
            ds.to_netcdf(nc, engine="h5netcdf", encoding=encoding)
            datasets[name] = xr.load_dataset(nc, engine="h5netcdf")
    return datasets


@dataclass
class _PredictJob:
    """What predicting a run's flights needs, checked before the first flight: the model, the flights, the
    data settings, where the products go and how they are flagged, and how frames are preprocessed."""

    rm: object
    names: list[str]
    chosen: dict
    data: DataConfig
    folder: PredictionsFolder
    backend: Backend

    @contextmanager
    def predictor(self):
        cfg = self.rm.cfg
        with FramePool(resolve_workers(cfg.data.preprocess_workers)) as pool:
            yield FlightPredictor(
                self.rm.model,
                Scalers.from_dict(self.rm.ckpt[Key.SCALERS]),
                self.rm.device,
                eval_batch_size(cfg.train.batch_size),
                self.rm.autocast,
                self.backend,
                pool,
                *recorded(self.rm.ckpt.get(Key.DOMAIN)),
            )


def _evaluation_of(run: RunFolder, weights: str) -> dict:
    """The run's evaluation.json where it scored the very weights predicting (checkpoint.weights_sha256; an
    earlier release's, without it, as it is); else only why its skill is not theirs (said once here, and in
    each file's model_test_skill: best.pt was replaced, or put back from a backup, after the evaluation)."""
    evaluation = run.files.evaluation()
    recorded = evaluation.get("weights_sha256")
    if not recorded or recorded == weights:
        return evaluation
    why = (
        "evaluation.json scored other weights than best.pt holds now (best.pt was replaced, or put back from "
        "a backup, after the evaluation): run `evaluate` on the run, or train it again to its end"
    )
    log.warning("%s: the files carry no test skill. %s", run.best, why)
    return {"unproven": why}


def _prepare(
    run: RunFolder, flights, data_dir, calibration_dir, cache_dir, cloud_flag: str, out: Path | None
) -> _PredictJob:
    """The model loaded and everything checked; `out` (None: nothing is written) made or adopted as
    CloudML's before a file goes into it."""
    rm = load_run_model(run, data_dir, command="predict", cache_dir=cache_dir)
    cfg, ckpt = rm.cfg, rm.ckpt
    flagging = choose_flagging(cfg, ckpt, cloud_flag, run)
    weights = weights_sha256(ckpt[Key.MODEL])  # once a command: the files say whose skill and intervals
    calibration = _calibration(run, calibration_dir, weights)
    names = flights or list(cfg.data.test_flights)
    chosen = flights_to_predict(cfg, names)
    if out is not None:
        claim(out, PREDICTIONS)
    summary = _read_summary(out / "summary.json") if out is not None else {}
    folder = PredictionsFolder(out, run, calibration, summary, flagging, _evaluation_of(run, weights))
    backend = resolve_backend(cfg.data.preprocess_device, trained_backend(ckpt.get(Key.PROVENANCE)))
    data = DataConfig(**{**vars(cfg.data), "angles_source": "nav"})
    return _PredictJob(rm, names, chosen, data, folder, backend)


@dataclass
class PredictionsFolder:
    """Where predict writes (--out), for which run, with which calibration of the intervals, the summary.json
    it keeps as it goes (one entry per flight), how the cloud flag is made, and the run's evaluation."""

    out: Path
    run: RunFolder
    calibration: dict | None
    summary: dict
    flagging: Flagging = Flagging()
    evaluation: dict | None = None  # the run's evaluation.json (read as untrusted), for the files' skill

    @property
    def summary_path(self) -> Path:
        return self.out / "summary.json"


def flight_result(
    predictor: FlightPredictor,
    rm,
    flight: FlightConfig,
    name: str,
    data: DataConfig,
    folder: PredictionsFolder,
) -> dict:
    """One flight predicted: its heights, cloud flag and intervals, and what its files say about them."""
    cfg, ckpt, calibration = rm.cfg, rm.ckpt, folder.calibration
    result = predict_flight(predictor, flight, data)
    result["flight"], result["height_head"] = name, cfg.model.height_head
    result["source"] = model_source(cfg, ckpt, folder.run)
    learned, result["learned_from"] = learned_range(ckpt, cfg)
    cloud_and_intervals(result, folder.flagging, calibration, height_bounds_km(cfg.data), learned)
    flag_unseen(result, predictor.domain, predictor.unchecked, name)
    result["calibration"], result["cloud_threshold"] = calibration, cfg.model.cloud_threshold
    result["flagging"], result["role"] = folder.flagging, flight_role(name, ckpt, cfg)
    result["seen_in_calibration"] = seen_in_calibration(name, calibration, ckpt, cfg)
    result["counts"]["interval_calibrated_here"] = result["seen_in_calibration"]
    result["evaluation"] = folder.evaluation
    paths = {role: Path(data.dir) / getattr(flight, f"{role}_file") for role in ("ir", "cpl", "nav")}
    result["provenance"] = {
        "label_definition": cpl.label_definition(data),
        "trained_on": ckpt.get(Key.PROVENANCE),
        "preprocess": {
            "backend": predictor.backend.name,
            "device": predictor.backend.device,
            "workers": predictor.pool.workers,
        },
        "input_files": input_files(
            {r: p for r, p in paths.items() if p.is_file() and p != Path(data.dir)}, cache_root(data)
        ),
    }
    if calibration and result["seen_in_calibration"]:
        log.info(
            "flight %s: the intervals were calibrated on heights of this flight (%s): the share of CPL "
            "heights inside them is no measure of their coverage here",
            name,
            calibration.get("source", "?"),
        )
    return result


def _write_flight(result: dict, name: str, folder: PredictionsFolder) -> Path:
    """One flight's NetCDF, CSV, plots and line of summary.json."""
    out = folder.out
    nc = out / f"{name}_cbh.nc"
    write_netcdf(nc, name, result, folder.run)
    write_csv(out / f"{name}_cbh.csv", result)
    along, track = flight_figures(name, result)
    plots.save_figure(along, out / f"{name}_cbh_along_flight.png")
    plots.save_figure(track, out / f"{name}_track.png")
    folder.summary[name] = dict(
        result["counts"],
        variables=products.summary(result),
        inputs_vs_training=result.get("inputs_vs_training"),
    )
    write_text(folder.summary_path, json.dumps(folder.summary, indent=1))
    log.info(
        "flight %s: %d of %d frames predicted -> %s (CSV and plots beside it)",
        name,
        result["counts"]["predicted"],
        result["counts"]["frames"],
        nc,
    )
    return nc


def model_source(cfg, ckpt: dict, run: RunFolder) -> str:
    """The model that wrote a file, in words for its `source` attribute: what it is, which weights, its run's
    name (never a path of the machine)."""
    what = (
        "a network on its scalar inputs alone (the sun's angles and what else the run gives it), no frames"
        if cfg.model.scalars_only or getattr(cfg.data, "atmosphere", "none") == "alone"
        else f"a convolutional network over {cfg.data.temporal_frames} thermal-IR frames (channels "
        f"{', '.join(map(str, cfg.model.channels))})"
    )
    epoch = ckpt.get(Key.EPOCH)
    return (
        f"CloudML {package_version()} model: {what}, the best weights"
        + (f" (epoch {epoch})" if isinstance(epoch, int) else "")
        + f" of run '{run.path.name}'"
    )


def flight_role(name: str, ckpt: dict, cfg) -> str:
    """What the flight was to the run, in words: a test flight, validation data, trained on, or none."""
    split = ckpt.get(Key.SPLIT) if isinstance(ckpt.get(Key.SPLIT), dict) else {}
    validation = split.get("validation") if isinstance(split.get("validation"), dict) else {}
    if name in cfg.data.test_flights:
        if split.get("rule", LEGACY_VALIDATION) == LEGACY_VALIDATION:
            return (
                "a test flight of this run, on which its best epoch and intervals were chosen (CloudML 0.2)"
            )
        return "a test flight of this run: nothing was trained or chosen on it"
    if name in validation:
        part = validation[name]
        return (
            "a validation flight of this run: it chose the best epoch and calibrated the intervals"
            if isinstance(part, str)
            else f"a training flight of this run whose frames from {part.get('first_frame')} on were its "
            "validation data (they chose the best epoch and calibrated the intervals)"
        )
    if name in {f.name for f in cfg.data.flights}:
        return "a training flight of this run: the model was fitted on it"
    return "not one of this run's flights: never seen in training"


def seen_in_calibration(name: str, calibration: dict | None, ckpt: dict, cfg) -> bool:
    """Whether the intervals were calibrated on heights of this flight (then the share of its CPL heights
    inside them is no measure of their coverage)."""
    if not calibration:
        return False
    if isinstance(calibration.get("flights"), list):
        return name in calibration["flights"]
    split = ckpt.get(Key.SPLIT) if isinstance(ckpt.get(Key.SPLIT), dict) else {}
    legacy = split.get("rule", LEGACY_VALIDATION) == LEGACY_VALIDATION
    source = str(calibration.get("source", ""))
    # an earlier release's run calibrated on its held-out flights; its cross-validation on every fold's
    crossval = "leave-one-flight-out" in source and name in {f.name for f in cfg.data.flights}
    return (legacy and name in cfg.data.test_flights) or crossval


def _calibration(run: RunFolder, calibration_dir, weights: str) -> dict | None:
    """The intervals' calibration: --calibration's folder, else the run's where it was made for these weights
    (`weights`: their sha256; intervals.of_weights); None (said) when there is none."""
    folder = Path(calibration_dir) if calibration_dir else run.path
    if calibration_dir and not (folder / intervals.FILE).is_file():
        raise CloudMLError(
            f"--calibration {folder}: no {intervals.FILE} there; point it at a finished cross-validation "
            "(python -m cloudml_lib crossval ...) or a finished run"
        )
    if calibration_dir:
        files = RunFiles(folder)
        cal = files.intervals()
        if cal is None:  # asked for by name: no silent run without intervals
            raise CloudMLError(
                f"--calibration {folder}: {'; '.join(files.damaged)}. Point it at a finished "
                "cross-validation (python -m cloudml_lib crossval ...) or a finished run. Nothing was "
                "written."
            )
    else:
        cal = intervals.of_weights(intervals.load(folder), weights, run.best)
    if cal is None:
        log.warning(
            "%s has no usable %s (a run from an earlier CloudML, or too few validation heights): heights "
            "without "
            "prediction intervals. Finish training with this version, or pass --calibration CROSSVAL_DIR.",
            folder,
            intervals.FILE,
        )
    else:
        log.info(
            "prediction intervals: %s, %.0f%% target, calibrated on %d heights from %s; %s",
            cal["method"],
            100 * cal["coverage"],
            cal["n"],
            cal["source"],
            spread_words(cal),
        )
    return cal


def _read_summary(path: Path) -> dict:
    """The predictions folder's summary.json (a line per flight predicted before); {} when damaged, said."""
    files = RunFiles(path.parent)
    summary = files.predictions_summary()
    for d in files.damaged:
        log.warning("%s: it is written again with the flights predicted now", d)
    return summary
