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

import csv
import json
import logging
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from cloudml_lib.base.config import LEGACY_VALIDATION, DataConfig, FlightConfig, height_bounds_km
from cloudml_lib.base.errors import CloudMLError, DataError, shown
from cloudml_lib.base.outputs import atomic_path, write_text
from cloudml_lib.base.ownership import Kind, claim
from cloudml_lib.base.resources import package_version
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core.network.inference import StreamEncoder, eval_batch_size, windows_forward
from cloudml_lib.core.network.metrics import Scored, cloud_class, outside_bounds
from cloudml_lib.core.run.checkpoint import Key
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
from cloudml_lib.science.baselines import SHORT
from cloudml_lib.science.clouds import bt_flag
from cloudml_lib.science.evaluate import load_run_model
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


@dataclass(frozen=True)
class Flagging:
    """How a frame's cloud flag is made: from the model's probability at `threshold` (and its classes), or
    from the brightness-temperature baseline (`source` bt_threshold, `baseline`: clouds.fitted_baseline);
    `definition`: what the flag marks (data.cloud_flag)."""

    threshold: float = 0.5
    source: str = "model"
    definition: str = "any_layer"
    baseline: dict | None = None


def cloud_and_intervals(
    result: dict,
    flagging: Flagging,
    calibration: dict | None,
    bounds: tuple[float, float] = (0.0, np.inf),
    learned: tuple[float, float] | None = None,
) -> None:
    """The cloud flag of each frame (cpl's classes, or 1 cloud / 0 none; -1 unknown: a blank frame or no cloud
    output), the height kept only where a cloud (base in the range) is flagged and inside `bounds`
    (bound_heights), and its interval bounds; counts added to result["counts"]."""
    counts = result["counts"]
    flag = frame_flags(result, flagging)
    if flag is not None:
        result["cbh_km"] = np.where(flag == 1, result["cbh_km"], np.nan)  # a height only under its cloud
        counts["clear_sky"], counts["cloud"] = int((flag == 0).sum()), int((flag == 1).sum())
        if (flag >= 2).any() or flagging.definition == "base_in_range":
            counts["cloud_above_range"], counts["cloud_below_range"] = (
                int((flag == 2).sum()),
                int((flag == 3).sum()),
            )
        truth = np.isfinite(result["cpl_cloud"]) & (flag >= 0)
        counts["cpl_cloud_agreement"] = (
            float(((flag[truth] == 1) == (result["cpl_cloud"][truth] == 1)).mean()) if truth.any() else None
        )
    result["cloud_flag"] = flag  # no cloud output: no cloud variables
    ceiling = bound_heights(result, bounds, learned)
    result["lower"], result["upper"] = (
        intervals.bounds(result["cbh_km"], calibration)
        if calibration
        else (np.full(len(result["t"]), np.nan),) * 2
    )
    if calibration:  # an interval reaching below the surface or above the ceiling means nothing there
        result["lower"] = np.maximum(result["lower"], bounds[0])
        result["upper"] = np.minimum(result["upper"], ceiling)
    if calibration:
        has = np.isfinite(result["label"]) & np.isfinite(result["lower"])
        counts["cpl_inside_interval"] = (
            float(
                (
                    (result["label"][has] >= result["lower"][has])
                    & (result["label"][has] <= result["upper"][has])
                ).mean()
            )
            if has.any()
            else None
        )
        counts["cpl_interval_n"] = int(has.sum())


def frame_flags(result: dict, flagging: Flagging) -> np.ndarray | None:
    """Each frame's flag (int8, -1 unknown) by `flagging`; None where the model has no cloud output and the
    model's flag is asked for."""
    if flagging.source == "bt_threshold":
        flag = bt_flag(result["p10"], flagging.baseline)
        if flagging.definition != "base_in_range":
            flag = np.where(flag == 2, 1, flag)  # colder than a threshold: cloud, whatever its height
        return flag.astype(np.int8)
    if result["cloud_probability"] is None:
        return None
    classes = cloud_class(result["cloud_probability"], result.get("class_probability"), flagging.threshold)
    return classes.astype(np.int8)


# cloud_base_height_qc (products.py); -1: no height predicted. 3 came later: appended, so that files written
# before keep the meanings of 0-2.
QC_INSIDE, QC_BELOW, QC_ABOVE, QC_UNLEARNED = 0, 1, 2, 3
QC_UNSEEN = 4  # a height kept, on a frame whose inputs lie outside the training samples' (data/domain.py)


def bound_heights(
    result: dict, bounds: tuple[float, float], learned: tuple[float, float] | None = None
) -> np.ndarray:
    """Heights that cannot be a cloud base are never given as one: below `bounds[0]` (the surface), or above
    the ceiling (the aircraft's altitude where the nav file gives it, else `bounds[1]`, data.cbh_max_km) they
    are masked (NaN) and flagged in result["cbh_qc"]; a height within float rounding of a bound is put on it.
    A height kept but outside `learned` (the span of the labels the model was fitted on; data.cbh_min_km to
    data.cbh_max_km for a run that did not record it) is an extrapolation: flagged QC_UNLEARNED, kept. Counted
    in result["counts"] and said in the log. Returns the ceiling per frame (km)."""
    height, counts = result["cbh_km"], result["counts"]
    altitude = result.get("altitude_km")
    known = np.isfinite(altitude) if altitude is not None else np.zeros(height.size, bool)
    ceiling = np.where(known, altitude, bounds[1]) if known.any() else np.full(height.size, bounds[1])
    below, above = outside_bounds(height, bounds[0], ceiling)
    qc = np.where(np.isfinite(height), QC_INSIDE, -1).astype(np.int8)
    qc[below], qc[above] = QC_BELOW, QC_ABOVE
    with np.errstate(invalid="ignore"):
        result["cbh_km"] = np.where(below | above, np.nan, np.clip(height, bounds[0], ceiling))
        kept = result["cbh_km"]
        unlearned = (
            np.isfinite(kept) & ((kept < learned[0]) | (kept > learned[1]))
            if learned is not None
            else np.zeros(kept.size, bool)
        )
    qc[unlearned] = QC_UNLEARNED
    result["cbh_qc"], result["height_bounds"] = qc, (float(bounds[0]), float(bounds[1]))
    if learned is not None:
        result["learned_range"] = (float(learned[0]), float(learned[1]))
    counts.update(
        height_below_surface=int(below.sum()),
        height_above_ceiling=int(above.sum()),
        altitude_known=int(known.sum()),
    )
    if learned is not None:
        counts["height_outside_labels"] = int(unlearned.sum())
    if unlearned.any():
        log.info(
            "flight %s: %d predicted heights lie outside %.2f-%.2f km (%s): kept as extrapolations, flagged "
            "%d "
            "in cloud_base_height_qc",
            result.get("flight", "?"),
            int(unlearned.sum()),
            learned[0],
            learned[1],
            result.get("learned_from", "the labels the model learned from"),
            QC_UNLEARNED,
        )
    if below.any() or above.any():
        log.warning(
            "flight %s: %d predicted heights cannot be a cloud base and are left out (missing, flagged in "
            "cloud_base_height_qc): %d below the surface (%.2f km), %d above %s.%s",
            result.get("flight", "?"),
            int(below.sum() + above.sum()),
            int(below.sum()),
            bounds[0],
            int(above.sum()),
            f"the aircraft or {bounds[1]:.2f} km (data.cbh_max_km)"
            if known.any()
            else f"{bounds[1]:.2f} km (data.cbh_max_km)",
            ""
            if result.get("height_head") == "bounded"
            else " This model was trained before model.height_head existed; a new run's heights stay "
            "inside these bounds.",
        )
    return ceiling


def flag_unseen(result: dict, predictor: FlightPredictor, name: str) -> None:
    """The domain check's verdict on the flight: a height given on a frame whose inputs lie outside the
    training samples' gets QC_UNSEEN where it had QC_INSIDE (a height outside the labels' span keeps
    QC_UNLEARNED, a masked one its own flag), counted; the flight's sentence in the log and in
    result["inputs_vs_training"]."""
    if predictor.domain is None:
        result["inputs_vs_training"] = f"flight {name}: {predictor.unchecked}"
        log.info("flight %s: %s", name, predictor.unchecked)
        return
    qc, outside = result["cbh_qc"], result.pop("inputs_outside")
    given = np.isfinite(result["cbh_km"])  # the heights the file gives (a cloud base flagged, in bounds)
    unseen = outside & given & (qc == QC_INSIDE)  # a height outside the labels' span keeps its 3
    qc[unseen] = QC_UNSEEN
    result["counts"].update(
        inputs_outside_training=int(outside.sum()), height_inputs_outside=int(unseen.sum())
    )
    words = predictor.domain.words(name, result.pop("judged").subset(given), "heights")
    result["input_distance_threshold"] = predictor.domain.threshold
    result["inputs_vs_training"] = words + (
        f" (cloud_base_height_qc {QC_UNSEEN}, or {QC_UNLEARNED} where the height itself lies outside the "
        f"labels' span; {int(outside.sum())} of all {outside.size} frames, heights or not, lie outside: "
        "input_distance)"
    )
    (log.warning if (outside & given).any() else log.info)("%s", result["inputs_vs_training"])


def bounds_attributes(result: dict) -> dict:
    """The NetCDF attributes that say how cloud_base_height is bounded, by which head, and how many heights
    were masked."""
    low, high = result["height_bounds"]
    counts = result["counts"]
    head = result.get("height_head", "unbounded")
    return {
        "cloud_base_height_min_km": low,
        "cloud_base_height_max_km": high,
        "cloud_base_height_bounds": (
            f"a cloud base lies between {low:g} km (the sea surface: the labels are over the ocean) and "
            + (
                f"the aircraft's altitude from the nav file ({counts['altitude_known']} frames), else "
                if counts["altitude_known"]
                else "(the nav file gives no aircraft altitude) "
            )
            + f"{high:g} km (data.cbh_max_km, the top of the labels' range); a height outside is masked "
            "(missing) and flagged in cloud_base_height_qc; interval bounds are cut to the same range"
        ),
        "height_head": (
            "bounded: the model's height output cannot leave these bounds"
            if head == "bounded"
            else "unbounded: a model made before model.height_head existed; its heights outside the bounds "
            "are masked"
        ),
        "cloud_base_height_masked": (
            f"{counts['height_below_surface']} heights below the surface and "
            f"{counts['height_above_ceiling']} above the upper bound masked"
        ),
        **(
            {
                "cloud_base_height_outside_labels": (
                    f"{counts['height_outside_labels']} heights outside {result['learned_range'][0]:g}-"
                    f"{result['learned_range'][1]:g} km "
                    f"({result.get('learned_from', 'data.cbh_min_km to data.cbh_max_km')}:"
                    f" no label the model learned from lies there): kept, flagged {QC_UNLEARNED} "
                    "(outside_labels_range) in cloud_base_height_qc"
                )
            }
            if "height_outside_labels" in counts and "learned_range" in result
            else {}
        ),
    }


def write_netcdf(path: Path, flight: str, result: dict, run_dir: Path) -> None:
    """The NetCDF-4 file (CF-1.8) of products.VARIABLES, written with xarray's h5netcdf engine (both
    preinstalled on Colab) under a temporary name and renamed when complete (atomic_path): a full disk leaves
    no half file, and its error names the file."""
    ds, encoding = flight_dataset(flight, result, run_dir)
    with atomic_path(path) as tmp:
        ds.to_netcdf(tmp, engine="h5netcdf", encoding=encoding)


def flight_dataset(flight: str, result: dict, run_dir: Path):
    """The whole-flight product as an xarray Dataset (its variables and global attributes) and the encoding
    the NetCDF file stores it with."""
    counts, cal = result["counts"], result.get("calibration")
    record = result.get("provenance") or {}
    source = result.get("source") or f"a CloudML model of run '{Path(run_dir).name}'"
    attrs = {
        **products.discovery_attributes(flight, result, source, package_version()),
        "comment": (
            f"{counts['blank']} blank frames (no finite pixel or no contrast) have no height; "
            f"{counts['filled_pixels']} non-finite pixels were filled with their frame's median"
        ),
        "cloud_threshold": float(result.get("cloud_threshold", 0.5)),
        "interval_method": cal["method"] + " (MAPIE split conformal)" if cal else "none",
        "interval_coverage": float(cal["coverage"]) if cal else np.nan,
        "interval_calibration": f"{cal['n']} heights from {cal['source']}" if cal else "none",
        "interval_calibration_flights": spread_words(cal) if cal else "no intervals",
        "interval_calibrated_on_this_flight": (
            ("yes: the share of CPL heights inside the intervals is no measure of their coverage here")
            if result.get("seen_in_calibration")
            else "no"
        )
        if cal
        else "no intervals",
        "interval_coverage_on_this_flight": coverage_here(result),
        "flight_role": result.get("role", "unknown"),
        "inputs_vs_training": result.get("inputs_vs_training", "not checked"),
        **(
            {"input_distance_threshold": float(result["input_distance_threshold"])}
            if "input_distance_threshold" in result
            else {}
        ),
        **skill_attributes(flight, result.get("evaluation")),
        **flag_attributes(result),
        # JSON text: the label definition of the CPL labels here (and of the model's training data), the
        # SHA-256 of this flight's input files, and the training data's record (per-flight counts and files)
        "label_definition": json.dumps(record.get("label_definition")),
        "input_files": json.dumps(record.get("input_files")),
        "training_data_provenance": json.dumps(record.get("trained_on")),
        "preprocessing": json.dumps(record.get("preprocess")),  # the CLAHE backend, its device, workers
        **bounds_attributes(result),
    }
    return products.netcdf_dataset(
        result,
        attrs,
        f"{cal['coverage']:.0%}" if cal else "no",
        products.flag_variables(result["flagging"]) if "flagging" in result else {},
    )


def spread_words(cal: dict) -> str:
    """Whether a calibration holds the spread between flights, in words: calibrated on one flight, the
    intervals may fall short on another (the users' pooled intervals covered 27-34 % of some flights)."""
    flights = [str(f) for f in cal.get("flights") or []]
    if not flights:
        return "the flights it was calibrated on are not recorded (a calibration of an earlier release)"
    if len(flights) == 1:
        return (
            f"calibrated on one flight's heights ({flights[0]}): the spread between flights is not in them, "
            f"so on another flight they may hold less than their {float(cal['coverage']):.0%}; calibrated "
            "across flights: a cross-validation's intervals (predict --calibration CROSSVAL_DIR)"
        )
    return (
        f"calibrated across {len(flights)} flights' heights ({', '.join(flights)}): the spread between them "
        "is in them; a flight unlike all of them may still fall short"
    )


def coverage_here(result: dict) -> str:
    """The share of the flight's CPL heights inside its intervals, in words: whether it falls short of the
    target by more than binomial noise (the intervals do not hold here), or is no measure (calibrated
    here)."""
    from cloudml_lib.science.report import short_of_target

    cal, counts = result.get("calibration"), result["counts"]
    share, n = counts.get("cpl_inside_interval"), counts.get("cpl_interval_n", 0)
    if not cal or share is None or not n:
        return "not measured (no intervals, or no CPL height on this flight)"
    said = f"{share:.0%} of {n} CPL heights inside the {cal['coverage']:.0%} intervals"
    if result.get("seen_in_calibration"):
        return said + ": calibrated on this flight's heights, so no measure of their coverage"
    if short_of_target(share, n, float(cal["coverage"])):
        return said + (
            ": short of the target by more than chance (binomial, one-sided 2.5%): the intervals do not hold "
            "on this flight"
        )
    return said + ": within binomial noise of the target"


def skill_attributes(flight: str, evaluation: dict | None) -> dict:
    """Global attributes that say how good the model that wrote the file is, from evaluation.json (read as
    untrusted): `model_test_skill` is this flight's own test skill, where it was a test flight of the run, and
    says plainly that it is unmeasured where not; the run's other test flights' skill is apart
    (`model_test_skill_other_flights`), with the verdict and the protocol they were tested under."""
    from cloudml_lib.science.report import best_baseline, protocol_words, with_verdict

    if not evaluation:
        return {"model_test_skill": "not evaluated (the run has no evaluation.json)"}
    report = with_verdict(evaluation)
    per, base = report.get("per_flight") or {}, report.get("baseline_per_flight") or {}
    intervals_km = report.get("mae_interval_km") or {}

    def skill_of(name: str, m: dict) -> str:
        return (
            f"{name}: R2 {_num(m.get('r2'))}, MAE {_num(m.get('mae_km'))} km"
            + (
                f" (95% {intervals_km[name][0]:.3f}-{intervals_km[name][1]:.3f})"
                if intervals_km.get(name)
                else ""
            )
            + f", n {m.get('n')}"
            + (f"; training mean MAE {_num(base[name].get('mae_km'))} km" if name in base else "")
            + _best_words(best_baseline(report, name))
        )

    others = "; ".join(skill_of(name, m) for name, m in per.items() if name != flight and isinstance(m, dict))
    own = per.get(flight)
    return {
        "model_test_skill": skill_of(flight, own)
        if isinstance(own, dict)
        else f"not measured on this flight: {flight} was not a test flight of the run (the skill on its "
        "test flights, in model_test_skill_other_flights, is no measure of the skill here)",
        "model_test_skill_other_flights": others or "none",
        "model_verdict": report.get("verdict") or "none",
        "model_evaluation_protocol": protocol_words(report),
    }


def _num(v) -> str:
    return f"{v:.3f}" if isinstance(v, (int, float)) and np.isfinite(v) else "undefined"


def _best_words(best: dict | None) -> str:
    """ "; best baseline (linear on brightness) MAE 0.118 km, MAE skill against it +0.17" ("" without one)."""
    if not best or best.get("skill") is None:
        return ""
    return (
        f"; best baseline ({SHORT.get(best['name'], best['name'])}) MAE {_num(best['mae_km'])} km, MAE skill "
        f"against it {best['skill']:+.2f}"
    )


def flag_attributes(result: dict) -> dict:
    """Global attributes that say which cloud flag the file holds and what it marks."""
    f: Flagging = result.get("flagging") or Flagging()
    if f.source == "bt_threshold":
        b = f.baseline or {}
        source = (
            f"the brightness-temperature baseline ({b.get('kind')} on frame_p10, the 10th percentile of the "
            f"frame's stored values: {bt_bounds_words(b)}), fitted on the training flights"
        )
    else:
        source = f"the model (cloud probability at or above {f.threshold:g})"
    return {"cloud_flag_source": source, "cloud_flag_definition": products.flag_definition(f.definition)}


def bt_bounds_words(b: dict) -> str:
    """The brightness-temperature baseline's bounds in the IR files' stated units: "below 10520 stored
    (285.2 K, by the file's scale_factor 0.01 and add_offset 180)", "below 285.2 K", or in the file's own
    numbers where it states no units (or a run ended before the units were kept)."""

    def one(v) -> str:
        if v is None:
            return "open"
        units, scale, offset = b.get("units"), b.get("scale", 1.0), b.get("offset", 0.0)
        if units in (None, "unstated"):
            why = "it states no units" if units else "units not recorded by the CloudML that ended the run"
            return f"{v:g} in the IR file's own numbers ({why})"
        if (scale, offset) == (1.0, 0.0):
            return f"{v:g} {units}"
        unpacked = f"{v * scale + offset:.4g} {units}"
        return f"{v:g} stored ({unpacked}, by the file's scale_factor {scale:g} and add_offset {offset:g})"

    return f"from {one(b.get('low'))} to {one(b.get('high'))}"


def write_csv(path: Path, result: dict) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(products.csv_header())
        w.writerows(products.csv_rows(result))


def _mark_heights(ax, hours: np.ndarray, result: dict) -> None:
    """Heights outside the labels' range (kept: extrapolations) and heights masked, drawn apart."""
    qc = np.asarray(result.get("cbh_qc", np.zeros(len(hours))), np.int64)
    unlearned = qc == QC_UNLEARNED
    if unlearned.any():  # drawn apart: heights no label the model learned from lies at
        low, high = result.get("learned_range", (np.nan, np.nan))
        ax.plot(
            hours[unlearned],
            result["cbh_km"][unlearned],
            "x",
            ms=4,
            color="tab:purple",
            label=f"outside {low:g}-{high:g} km, the labels' range (extrapolated)",
        )
    masked = (qc == QC_BELOW) | (qc == QC_ABOVE)
    if masked.any():  # a tick along the bottom where a height was left out as no cloud base
        ax.plot(
            hours[masked],
            np.full(int(masked.sum()), 0.02),
            "|",
            ms=6,
            color="tab:orange",
            transform=ax.get_xaxis_transform(),
            label="height masked (below the surface or above the bound)",
        )


# stretches without a height drawn behind the line, by the frame's flag: (flag value, colour, label)
NO_HEIGHT_SHADES = (
    (0, "0.85", "clear sky (predicted)"),
    (2, "#d8cdea", "cloud only above the range: no height (predicted)"),
    (3, "#f3dcc4", "a base below the range: no height (predicted)"),
)


def flight_figures(flight: str, result: dict) -> tuple[Figure, Figure]:
    hours = (result["t"] - result["t"][0]) / 3600.0
    along = Figure(figsize=(11, 4.4))
    ax = along.subplots()
    flag = result.get("cloud_flag")
    flags = np.full(len(hours), -1) if flag is None else np.asarray(flag)
    clear = flags == 0
    for value, colour, label in NO_HEIGHT_SHADES:
        if (flags == value).any():
            ax.fill_between(
                hours,
                0,
                1,
                where=flags == value,
                transform=ax.get_xaxis_transform(),
                color=colour,
                step="mid",
                lw=0,
                label=label,
            )
    lower, upper = result.get("lower"), result.get("upper")
    if lower is not None and np.isfinite(lower).any():
        cal = result.get("calibration") or {}
        ax.fill_between(
            hours,
            lower,
            upper,
            color="tab:blue",
            alpha=0.25,
            lw=0,
            label=f"{cal.get('coverage', 0):.0%} interval",
        )
    ax.plot(hours, result["cbh_km"], lw=0.8, label="predicted")
    _mark_heights(ax, hours, result)
    has = np.isfinite(result["label"])
    ax.plot(hours[has], result["label"][has], "o", ms=3, color="tab:red", label="CPL lidar")
    ax.set(xlabel="hours since the first frame", ylabel="cloud base height (km)", title=f"Flight {flight}")
    # below the axes: a legend inside would cover the heights of the flight's last stretch
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, fontsize=8, frameon=False)
    ax.grid(alpha=0.3)
    along.tight_layout()
    track = Figure(figsize=(6, 5))
    ax = track.subplots()
    if clear.any():
        ax.scatter(result["lon"][clear], result["lat"][clear], s=4, color="0.8", label="clear sky")
        ax.legend(loc="best", fontsize=8)
    sc = ax.scatter(result["lon"], result["lat"], c=result["cbh_km"], s=4, cmap="viridis")
    track.colorbar(sc, ax=ax, label="predicted cloud base height (km)")
    ax.set(xlabel="longitude (deg)", ylabel="latitude (deg)", title=f"Flight {flight}: track")
    track.tight_layout()
    return along, track


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
        write_report(run.path)
    return written


def predict_datasets(
    run: RunFolder | str | Path,
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

    job = _prepare(RunFolder.of(run), flights, data_dir, calibration_dir, cache_dir, cloud_flag, None)
    datasets = {}
    with job.predictor() as predictor, tempfile.TemporaryDirectory(prefix="cloudml-predict-") as tmp:
        for name in job.names:
            result = flight_result(predictor, job.rm, job.chosen[name], name, job.data, job.folder)
            ds, encoding = flight_dataset(name, result, job.folder.run_dir)
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


def _prepare(
    run: RunFolder, flights, data_dir, calibration_dir, cache_dir, cloud_flag: str, out: Path | None
) -> _PredictJob:
    """The model loaded and everything checked; `out` (None: nothing is written) made or adopted as
    CloudML's before a file goes into it."""
    rm = load_run_model(run, data_dir, command="predict", cache_dir=cache_dir)
    cfg, ckpt = rm.cfg, rm.ckpt
    flagging = choose_flagging(cfg, ckpt, cloud_flag, run.path)
    calibration = _calibration(run.path, calibration_dir)
    names = flights or list(cfg.data.test_flights)
    chosen = flights_to_predict(cfg, names)
    if out is not None:
        claim(out, PREDICTIONS)
    summary = _read_summary(out / "summary.json") if out is not None else {}
    folder = PredictionsFolder(out, run.path, calibration, summary, flagging, run.files.evaluation())
    backend = resolve_backend(cfg.data.preprocess_device, trained_backend(ckpt.get(Key.PROVENANCE)))
    data = DataConfig(**{**vars(cfg.data), "angles_source": "nav"})
    return _PredictJob(rm, names, chosen, data, folder, backend)


@dataclass
class PredictionsFolder:
    """Where predict writes (--out), for which run, with which calibration of the intervals, the summary.json
    it keeps as it goes (one entry per flight), how the cloud flag is made, and the run's evaluation."""

    out: Path
    run_dir: Path
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
    result["source"] = model_source(cfg, ckpt, folder.run_dir)
    learned, result["learned_from"] = learned_range(ckpt, cfg)
    cloud_and_intervals(result, folder.flagging, calibration, height_bounds_km(cfg.data), learned)
    flag_unseen(result, predictor, name)
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
    write_netcdf(nc, name, result, folder.run_dir)
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


CLOUD_FLAGS = ("model", "bt_threshold")  # predict --cloud-flag


def choose_flagging(cfg, ckpt: dict, cloud_flag: str, run_dir: Path) -> Flagging:
    """How the files' cloud flag is made (--cloud-flag): the model's, or the brightness-temperature baseline
    best.pt keeps (a CloudMLError naming what to do where it keeps none)."""
    if cloud_flag not in CLOUD_FLAGS:
        raise CloudMLError(f"--cloud-flag {shown(cloud_flag)}: choose one of {', '.join(CLOUD_FLAGS)}")
    definition = cfg.data.cloud_flag
    if cloud_flag == "model":
        return Flagging(cfg.model.cloud_threshold, "model", definition)
    baseline = ckpt.get(Key.CLOUD_BASELINE)
    valid = (
        isinstance(baseline, dict)
        and baseline.get("kind") in ("window", "threshold")
        and all(
            v is None or (isinstance(v, float) and np.isfinite(v))
            for v in (baseline.get("low"), baseline.get("high"))
        )
    )
    if not valid:
        raise CloudMLError(
            f"--cloud-flag bt_threshold: {run_dir / 'best.pt'} holds no brightness-temperature baseline (a "
            "run "
            "ended by an earlier CloudML, or a damaged file). Evaluate the run's end again with this version "
            f"(python -m cloudml_lib train ... --run-dir {run_dir} after raising train.epochs), or use the "
            "model's flag. Nothing was written."
        )
    return Flagging(cfg.model.cloud_threshold, "bt_threshold", definition, baseline)


def model_source(cfg, ckpt: dict, run_dir: Path) -> str:
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
        + f" of run '{Path(run_dir).name}'"
    )


def learned_range(ckpt: dict, cfg) -> tuple[tuple[float, float], str]:
    """(the heights the model learned from, in words where they come from): the span of the labels it was
    fitted on (best.pt), or data.cbh_min_km to data.cbh_max_km for a run that did not record it."""
    span = ckpt.get(Key.LABEL_RANGE)
    if (
        isinstance(span, list)
        and len(span) == 2
        and all(isinstance(v, float) and np.isfinite(v) for v in span)
    ):
        if span[0] <= span[1]:
            return (span[0], span[1]), "the span of the labels the model was fitted on"
    return (float(cfg.data.cbh_min_km), float(cfg.data.cbh_max_km)), "data.cbh_min_km to data.cbh_max_km"


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


def _calibration(run_dir: Path, calibration_dir) -> dict | None:
    """The intervals' calibration: --calibration's folder, else the run's; None (said) when there is none."""
    folder = Path(calibration_dir) if calibration_dir else run_dir
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
        cal = intervals.load(folder)
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
