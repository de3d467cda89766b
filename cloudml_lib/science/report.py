"""RUN_DIR/report.md: a run's results in one page, readable on GitHub and in the notebook, and what the
numbers mean in words.

It is rewritten from the files the run already holds (evaluation.json, plots/, predictions/,
crossval.md, provenance.json), so any command that adds results (train, evaluate, predict, crossval) refreshes
it. Images are linked by paths relative to the run directory.

`shortcomings` is the one rule that says a model is of no use yet (its predictions collapse towards a
constant, or it does not beat the training mean); `verdict` says it in a sentence, for report.md, the
evaluation's text (evaluate.py) and the notebook; cross-validation warns by the same rule.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cloudml_lib.base import tables
from cloudml_lib.base.outputs import write_text
from cloudml_lib.base.runfiles import RunFiles
from cloudml_lib.core import provenance
from cloudml_lib.core.compile import describe_saved

REPORT = "report.md"

COLLAPSE_STD_RATIO = 0.3  # std(pred)/std(true) below this: the predictions collapse towards a constant


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and bool(np.isfinite(v))


def shortcomings(model: dict, baseline: dict) -> list[str]:
    """Why a model's heights are of no use, one clause each ([] when none): its predictions collapse towards a
    constant (std(pred)/std(true) below COLLAPSE_STD_RATIO), or it is no better than predicting the training
    mean (MAE not below the baseline's, or R2 below it). `model` and `baseline`: regression_metrics of the
    same samples. The rule of the evaluation's verdict and of cross-validation's warnings."""
    out = []
    ratio = model.get("std_ratio")
    if _finite(ratio) and ratio < COLLAPSE_STD_RATIO:
        out.append(
            f"the predictions collapse towards a constant (std(pred)/std(true) {ratio:.2f} < "
            f"{COLLAPSE_STD_RATIO})"
        )
    mae, base_mae, r2, base_r2 = (d.get(k) for k in ("mae_km", "r2") for d in (model, baseline))
    worse_mae = _finite(mae) and _finite(base_mae) and mae >= base_mae
    worse_r2 = _finite(r2) and _finite(base_r2) and r2 < base_r2
    if worse_mae or worse_r2:
        out.append(f"the model is no better than predicting the training mean ({_versus(model, baseline)})")
    return out


def _versus(model: dict, baseline: dict) -> str:
    """ "MAE 0.310 vs 0.290 km, R2 -0.35 vs -0.02": the model's numbers against the baseline's."""
    parts = []
    if _finite(model.get("mae_km")) and _finite(baseline.get("mae_km")):
        parts.append(f"MAE {model['mae_km']:.3f} vs {baseline['mae_km']:.3f} km")
    if _finite(model.get("r2")) and _finite(baseline.get("r2")):
        parts.append(f"R2 {model['r2']:.2f} vs {baseline['r2']:.2f}")
    return ", ".join(parts)


def verdict(report: dict) -> str | None:
    """The held-out result in a sentence: whether the model beats the training mean, or why it is of no use
    yet and what to try. None without held-out heights to judge by."""
    model, baseline = report.get("overall") or {}, report.get("baseline") or {}
    if not model.get("n") or not _finite(model.get("mae_km")):
        return None
    flights = ", ".join(report.get("per_flight") or {}) or "the held-out flights"
    problems = shortcomings(model, baseline)
    if problems:
        return (
            f"Verdict: this model is not useful yet on {flights}: "
            + " and ".join(problems)
            + ". Try more epochs, more flights, or check the labels."
        )
    return f"Verdict: the model beats predicting the training mean on {flights} ({_versus(model, baseline)})."


BASELINE_WORDS = (
    "Baselines, each fitted on the training flights only: *training mean* predicts the training labels' mean "
    "height for every frame; *majority class* says the training flights' commoner of cloud and clear sky "
    "everywhere; *brightness-temperature threshold* says cloud where a frame's 10th-percentile brightness is "
    "below the threshold that classifies the training flights best. A model worth using beats them."
)


def cloud_verdict(report: dict) -> str | None:
    """The cloud flag in a sentence, by the rule of the heights' verdict: the model against its baselines
    on accuracy and ROC-AUC over all held-out frames. None without a model's cloud output to judge."""
    cloud = report.get("cloud") or {}
    model = (cloud.get("model") or {}).get("overall") or {}
    if not model.get("n"):
        return None
    names = {"majority": "the majority class", "bt_threshold": "the brightness-temperature threshold"}
    beaten_by = []
    for key, words in names.items():
        base = (cloud.get(key) or {}).get("overall") or {}
        worse = [
            f"{label} {model[k]:.3f} vs {base[k]:.3f}"
            for k, label in (("accuracy", "accuracy"), ("roc_auc", "ROC-AUC"))
            if _finite(model.get(k)) and _finite(base.get(k)) and model[k] < base[k]
        ]
        if worse:
            beaten_by.append(f"{words} ({', '.join(worse)})")
    if beaten_by:
        return (
            "Cloud flag: the model's cloud / no-cloud is not useful yet: "
            + " and ".join(beaten_by)
            + " beat it. Use that baseline's flag for now, or train longer or on more flights."
        )
    acc = model.get("accuracy")
    return "Cloud flag: the model beats both baselines" + (f" (accuracy {acc:.3f})." if _finite(acc) else ".")


def bounds_in_words(c: dict) -> str:
    """build_report's out_of_bounds count as a sentence."""
    where = (
        f"outside {c['low_km']:.2f}..{c['high_km']:.2f} km (the surface to data.cbh_max_km, the heights a "
        "cloud base can have here)"
    )
    if not c["below"] and not c["above"]:
        return f"All {c['n']} predicted heights lie inside {c['low_km']:.2f}..{c['high_km']:.2f} km."
    return (
        f"{c['below'] + c['above']} of {c['n']} predicted heights lie {where}: {c['below']} below, "
        f"{c['above']} above. The metrics keep them as predicted; predict leaves them out (masked)."
    )


def with_verdict(report: dict) -> dict:
    """A stored evaluation (evaluation.json, perhaps written before verdicts existed) with its verdict."""
    return report if report.get("verdict") else {**report, "verdict": verdict(report)}


def _num(v) -> str:
    return "-" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.3f}")


METRIC_KEYS = ("r2", "mae_km", "rmse_km", "bias_km", "std_ratio", "n")


def metric_rows(report: dict) -> list[tuple[str, dict]]:
    """The report's rows, each saying whose numbers and which flights: the model's, then the baseline's, over
    all held-out flights and per flight (report.md and the text report alike)."""
    rows = [("model: all held-out flights", report["overall"])]
    rows += [(f"model: flight {k}", v) for k, v in report["per_flight"].items()]
    rows += [("baseline (training mean): all", report["baseline"])]
    rows += [
        (f"baseline (training mean): flight {k}", v)
        for k, v in (report.get("baseline_per_flight") or {}).items()
    ]
    return rows


def _metrics_table(report: dict) -> list[str]:
    header = ["", "R2", "MAE km", "RMSE km", "bias km", "std(pred)/std(true)", "n"]
    rows = [[name, *(_num(m.get(k)) for k in METRIC_KEYS)] for name, m in metric_rows(report)]
    return tables.markdown(header, rows).splitlines()


def cloud_table(report: dict) -> list[str]:
    """Markdown: cloud / no-cloud metrics of the model and its baselines, overall and per flight."""
    cloud = report.get("cloud")
    if not cloud:
        return []
    words = {
        "model": "model",
        "majority": "baseline (majority class)",
        "bt_threshold": "baseline (brightness-temperature threshold)",
    }
    rows = []
    for method in [m for m in words if m in cloud]:
        named = [("all", cloud[method]["overall"])]
        named += [(f"flight {k}", v) for k, v in cloud[method]["per_flight"].items()]
        rows += [
            [
                f"{words[method]}: {name}",
                *(_num(m.get(k)) for k in ("accuracy", "f1", "roc_auc", "cloud_share", "n")),
            ]
            for name, m in named
        ]
    header = ["cloud / no-cloud", "accuracy", "F1", "ROC-AUC", "cloudy share", "n"]
    lines = tables.markdown(header, rows).splitlines()
    if "model" not in cloud:
        lines += [
            "",
            "This model has no cloud output (trained by an earlier CloudML, with model.cloud_head: none, or "
            "not finished: a probe is fitted when training ends): only the baselines are scored.",
        ]
    return lines


def interval_lines(report: dict) -> list[str]:
    iv = report.get("intervals")
    if not iv:
        return []
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    km = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"{iv['coverage_target']:.0%} prediction intervals ({iv['method']}, MAPIE), calibrated on "
        f"{iv['calibration']}: on the same flights the coverage is near the target by construction; on "
        "flights "
        "never seen it is what cross-validation measures.",
        "",
    ]
    rows = [[k, pct(v["coverage"]), km(v["mean_width_km"]), v["n"]] for k, v in iv["per_flight"].items()]
    return lines + tables.markdown(["flight", "coverage", "mean width km", "n"], rows).splitlines()


def held_out_section(report: dict) -> list[str]:
    """The held-out flights: the verdict in a sentence, the metrics, predictions outside the bounds, clouds
    and intervals."""
    report = with_verdict(report)
    out = ["## Held-out flights", ""]
    out += [report["verdict"], ""] if report.get("verdict") else []
    out += [f"Best model from epoch {report.get('best_epoch', '?')}; metrics in km.", ""]
    out += _metrics_table(report) + [""]
    out += [bounds_in_words(report["out_of_bounds"]), ""] if report.get("out_of_bounds") else []
    if report.get("cloud"):
        out += cloud_table(report) + [""]
        out += [cloud_verdict(report), ""] if cloud_verdict(report) else []
    out += [BASELINE_WORDS, ""]
    out += interval_lines(report) + [""] if report.get("intervals") else []
    return out


def build_report_md(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    out = [f"# CloudML run `{run_dir.name}`", ""]
    files = RunFiles(run_dir)
    report = files.evaluation()
    if report:
        out += held_out_section(report)
    run = files.run_info()
    if run:
        out += [
            "## Training",
            "",
            f"Device: {run.get('device', '?')}; {run.get('processes', 1)} process(es); batch "
            f"size {run.get('batch_size', '?')}; {run.get('total_steps', '?')} optimizer steps planned.",
            "",
            f"torch.compile: {describe_saved(run.get('compile'))}.",
            "",
        ]
    out += provenance.markdown(files.provenance())
    for name, title in (("plots/curves.png", "Training curves"), ("plots/scatter.png", "Predicted vs true")):
        if (run_dir / name).is_file():
            out += [f"## {title}", "", f"![{title}]({name})", ""]
    predicted = RunFiles(run_dir / "predictions")
    out += whole_flights_section(run_dir, predicted.predictions_summary())
    files.damaged += predicted.damaged
    crossval = run_dir / "crossval.md"
    if crossval.is_file():
        out += ["## Cross-validation", "", *crossval.read_text().splitlines()[1:], ""]
    if files.damaged:
        out += ["## Files that could not be read", "", *(f"- {d}" for d in files.damaged), ""]
    return "\n".join(out)


def whole_flights_section(run_dir: Path, counts: dict) -> list[str]:
    """Each flight predicted into RUN_DIR/predictions: its files, its counts in words, its two figures."""
    flights = sorted((run_dir / "predictions").glob("*_cbh.nc"))
    if not flights:
        return []
    out = ["## Whole flights", ""]
    for nc in flights:
        flight = nc.name[: -len("_cbh.nc")]
        out += [
            f"### {flight}",
            "",
            f"Data: `predictions/{nc.name}` (NetCDF, CF) and `predictions/{flight}_cbh.csv`. "
            + counts_in_words(counts.get(flight)),
            "",
            f"![CBH along flight {flight}](predictions/{flight}_cbh_along_flight.png)",
            "",
            f"![Track of flight {flight}](predictions/{flight}_track.png)",
            "",
        ]
    return out


def counts_in_words(c: dict | None) -> str:
    """One flight's summary.json counts as a sentence ("" without them)."""
    if not c:
        return ""
    parts = [f"{c['predicted']} of {c['frames']} frames predicted"]
    if c["blank"]:
        parts.append(f"{c['blank']} blank frames (no finite pixel, or no contrast) have no height")
    if c["no_time"]:
        parts.append(f"{c['no_time']} frame{'s' * (c['no_time'] != 1)} without a usable time left out")
    if c["filled_pixels"]:
        parts.append(f"{c['filled_pixels']} non-finite pixels filled with their frame's median")
    if "cloud" in c:
        parts.append(f"{c['cloud']} frames cloudy, {c['clear_sky']} clear sky (no height)")
    masked = c.get("height_below_surface", 0) + c.get("height_above_ceiling", 0)
    if masked:
        parts.append(
            f"{masked} predicted heights could not be a cloud base and are left out (missing, flagged in "
            f"cloud_base_height_qc): {c.get('height_below_surface', 0)} below the surface, "
            f"{c.get('height_above_ceiling', 0)} above the upper bound"
        )
    if c.get("height_outside_labels"):
        parts.append(
            f"{c['height_outside_labels']} heights lie outside the labels' range the model learned from "
            "(data.cbh_min_km to data.cbh_max_km): extrapolations, kept and flagged 3 in cloud_base_height_qc"
        )
    if c.get("cpl_cloud_agreement") is not None:
        parts.append(
            f"the cloud flag agrees with the CPL lidar on {c['cpl_cloud_agreement']:.0%} of the frames it "
            "profiled"
        )
    if c.get("cpl_inside_interval") is not None:
        parts.append(f"{c['cpl_inside_interval']:.0%} of the CPL heights lie inside the intervals")
    return "; ".join(parts) + "."


def write_report(run_dir: str | Path) -> Path:
    return write_text(Path(run_dir) / REPORT, build_report_md(Path(run_dir)))
