"""The whole-flight files: `<name>_cbh.nc` (NetCDF-4, CF-1.8, a trajectory with ACDD discovery attributes),
`<name>_cbh.csv` and the two plots (height along the flight, the track coloured by height).

The variables come from one table (products.py); the attributes say what a reader needs to trust a number:
the model's test skill on this flight or why none is given (`skill_attributes`), how the cloud flag was made
(`flag_attributes`), where heights were masked or lie outside the labels' span (`bounds_attributes`), and
whether the intervals' calibration holds the spread between flights (`spread_words`, `coverage_here`).
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cloudml_lib.base.outputs import atomic_path
from cloudml_lib.base.resources import package_version
from cloudml_lib.science import products
from cloudml_lib.science.baselines import SHORT
from cloudml_lib.science.flagging import QC_ABOVE, QC_BELOW, QC_UNLEARNED, Flagging

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from cloudml_lib.base.layout import RunLayout

log = logging.getLogger(__name__)


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


def write_netcdf(path: Path, flight: str, result: dict, run: RunLayout) -> None:
    """The NetCDF-4 file (CF-1.8) of products.VARIABLES, written with xarray's h5netcdf engine (both
    preinstalled on Colab) under a temporary name and renamed when complete (atomic_path): a full disk leaves
    no half file, and its error names the file."""
    ds, encoding = flight_dataset(flight, result, run)
    with atomic_path(path) as tmp:
        ds.to_netcdf(tmp, engine="h5netcdf", encoding=encoding)


def flight_dataset(flight: str, result: dict, run: RunLayout):
    """The whole-flight product as an xarray Dataset (its variables and global attributes) and the encoding
    the NetCDF file stores it with."""
    counts, cal = result["counts"], result.get("calibration")
    record = result.get("provenance") or {}
    source = result.get("source") or f"a CloudML model of run '{run.path.name}'"
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
    if isinstance(evaluation.get("unproven"), str):  # predict.py: scored other weights than these
        return {"model_test_skill": f"not evaluated on these weights: {evaluation['unproven']}"}
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
    from matplotlib.figure import Figure

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
