"""RUN_DIR/report.md: a run's results in one page, readable on GitHub and in the notebook.

It is rewritten from the files the run already holds (evaluation.json, plots/, predictions/,
crossval.md, provenance.json), so any command that adds results (train, evaluate, predict, crossval) refreshes
it. Images are linked by paths relative to the run directory.
"""

from __future__ import annotations

from pathlib import Path

from cloudml_lib import provenance
from cloudml_lib.compile import describe_saved
from cloudml_lib.outputs import write_text
from cloudml_lib.runfiles import RunFiles

REPORT = "report.md"


def _metrics_table(report: dict) -> list[str]:
    keys = ("r2", "mae_km", "rmse_km", "bias_km", "std_ratio", "n")
    num = lambda v: "-" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.3f}")  # noqa: E731
    rows = [("model: all held-out flights", report["overall"])]
    rows += [(f"model: flight {k}", v) for k, v in report["per_flight"].items()]
    rows += [("baseline (training mean): all", report["baseline"])]
    rows += [
        (f"baseline (training mean): flight {k}", v)
        for k, v in (report.get("baseline_per_flight") or {}).items()
    ]
    lines = ["| | R2 | MAE km | RMSE km | bias km | std(pred)/std(true) | n |", "|" + "---|" * 7]
    return lines + [f"| {name} | " + " | ".join(num(m.get(k)) for k in keys) + " |" for name, m in rows]


def cloud_table(report: dict) -> list[str]:
    """Markdown: cloud / no-cloud metrics of the model and its baselines, overall and per flight."""
    cloud = report.get("cloud")
    if not cloud:
        return []
    num = lambda v: "-" if v is None else (f"{v:d}" if isinstance(v, int) else f"{v:.3f}")  # noqa: E731
    words = {
        "model": "model",
        "majority": "baseline (majority class)",
        "bt_threshold": "baseline (brightness-temperature threshold)",
    }
    lines = ["| cloud / no-cloud | accuracy | F1 | ROC-AUC | cloudy share | n |", "|" + "---|" * 6]
    for method in [m for m in words if m in cloud]:
        rows = [("all", cloud[method]["overall"])] + [
            (f"flight {k}", v) for k, v in cloud[method]["per_flight"].items()
        ]
        lines += [
            f"| {words[method]}: {name} | "
            + " | ".join(num(m.get(k)) for k in ("accuracy", "f1", "roc_auc", "cloud_share", "n"))
            + " |"
            for name, m in rows
        ]
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
        "| flight | coverage | mean width km | n |",
        "|---|---|---|---|",
    ]
    return lines + [
        f"| {k} | {pct(v['coverage'])} | {km(v['mean_width_km'])} | {v['n']} |"
        for k, v in iv["per_flight"].items()
    ]


def build_report_md(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    out = [f"# CloudML run `{run_dir.name}`", ""]
    files = RunFiles(run_dir)
    report = files.evaluation()
    if report:
        out += [
            "## Held-out flights",
            "",
            f"Best model from epoch {report.get('best_epoch', '?')}; metrics in km.",
            "",
        ]
        out += _metrics_table(report) + [""]
        out += cloud_table(report) + [""] if report.get("cloud") else []
        out += interval_lines(report) + [""] if report.get("intervals") else []
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
