"""Each frame's flags on a whole flight: whether a cloud base is flagged, how its height is judged, and its
interval.

`cloud_and_intervals` turns the model's answers on a flight (predict.py) into what the files give: the cloud
flag (`Flagging`: the model's probability at its threshold, or the brightness-temperature baseline), the
height only where a cloud base in the range is flagged, its prediction interval (intervals.py), and
`cloud_base_height_qc`: 0 inside the labels' span, 1 and 2 masked below the surface or above the bound
(`bound_heights`), 3 outside the span of the labels the model was fitted on (an extrapolation), 4 kept on a
frame whose inputs lie outside the training samples' (`flag_unseen`, data/domain.py). The values 0-2 keep
the meaning they had in files written before 3 and 4 existed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from cloudml_lib.base.errors import CloudMLError, shown
from cloudml_lib.base.layout import RunLayout
from cloudml_lib.core.network.metrics import cloud_class, outside_bounds
from cloudml_lib.core.run.checkpoint import Key
from cloudml_lib.data.domain import Domain
from cloudml_lib.science import intervals
from cloudml_lib.science.clouds import bt_flag

log = logging.getLogger(__name__)


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


def flag_unseen(result: dict, domain: Domain | None, unchecked: str, name: str) -> None:
    """The domain check's verdict on the flight: a height given on a frame whose inputs lie outside the
    training samples' gets QC_UNSEEN where it had QC_INSIDE (a height outside the labels' span keeps
    QC_UNLEARNED, a masked one its own flag), counted; the flight's sentence in the log and in
    result["inputs_vs_training"]."""
    if domain is None:
        result["inputs_vs_training"] = f"flight {name}: {unchecked}"
        log.info("flight %s: %s", name, unchecked)
        return
    qc, outside = result["cbh_qc"], result.pop("inputs_outside")
    given = np.isfinite(result["cbh_km"])  # the heights the file gives (a cloud base flagged, in bounds)
    unseen = outside & given & (qc == QC_INSIDE)  # a height outside the labels' span keeps its 3
    qc[unseen] = QC_UNSEEN
    result["counts"].update(
        inputs_outside_training=int(outside.sum()), height_inputs_outside=int(unseen.sum())
    )
    words = domain.words(name, result.pop("judged").subset(given), "heights")
    result["input_distance_threshold"] = domain.threshold
    result["inputs_vs_training"] = words + (
        f" (cloud_base_height_qc {QC_UNSEEN}, or {QC_UNLEARNED} where the height itself lies outside the "
        f"labels' span; {int(outside.sum())} of all {outside.size} frames, heights or not, lie outside: "
        "input_distance)"
    )
    (log.warning if (outside & given).any() else log.info)("%s", result["inputs_vs_training"])


CLOUD_FLAGS = ("model", "bt_threshold")  # predict --cloud-flag


def choose_flagging(cfg, ckpt: dict, cloud_flag: str, run: RunLayout) -> Flagging:
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
            f"--cloud-flag bt_threshold: {run.best} holds no brightness-temperature baseline (a "
            "run "
            "ended by an earlier CloudML, or a damaged file). Evaluate the run's end again with this version "
            f"(python -m cloudml_lib train ... --run-dir {run} after raising train.epochs), or use the "
            "model's flag. Nothing was written."
        )
    return Flagging(cfg.model.cloud_threshold, "bt_threshold", definition, baseline)


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
