"""A few labels of the test flight: how much of the skill they recover, scored honestly, on each demo flight;
and whose intervals hold on a flight never seen.

    python benchmarks/adaptation.py      # writes benchmarks/results/adaptation.json (about 15 min on 2 cores)
    python benchmarks/adaptation.py --epochs 2 --seeds 42 --results /tmp/a.json   # a quick look

The nested cross-validation `crossval` runs (the five demo flights of configs/demo.yaml, generator 4 with its
ERA5 files; each the test flight once, nothing chosen on it), with its adaptation curve
(train.adaptation_labels [10, 25, 50]; science/adapt.py): on each test flight the fold's network has its head
fine-tuned on the flight's first N labels in time, the baselines get the same N labels, the intervals are
calibrated on them by cross-fitting, and every N is scored on the same labels after the largest block and a
gap. The CPU budget of benchmarks/atmosphere.py: 6 epochs per fold, no cloud output.

Per N: the network's MAE and the best adapted baseline's, the mean over the flights of each seed, then their
mean and spread over the seeds; how many flight-seeds call the network better, level or worse (the paired
MAE difference over time blocks); the intervals' coverage. Per flight and seed, the whole curve.

The intervals on each test flight (N = 0), two calibrations side by side: the fold's own (on its validation
data drawn from its training flights, as a single run calibrates) and crossval's across flights (each flight's
intervals calibrated on the other folds' test flights, the method chosen on them: what `predict --calibration
CROSSVAL_DIR` carries into a run); per flight their coverage and whether it falls short of the 90% target by
more than binomial noise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import PROTOCOL, machine  # noqa: E402
from benchmarks.radiometry import _spread, demo_crossval  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "adaptation"
SEEDS = (42, 7, 1)
LABELS = (10, 25, 50)


def one_run(seed: int, epochs: int, warmup: int) -> dict:
    """One cross-validation with its adaptation curves: per flight, per N, what the summary reads."""
    setting = f"train.adaptation_labels=[{', '.join(map(str, LABELS))}]"
    result, seconds, run = demo_crossval(SCRATCH, f"adapt-{seed}", setting, seed, epochs, warmup)
    return {
        "seed": seed,
        "seconds": seconds,
        "flights": curves(result),
        "intervals": interval_coverage(result, run),
    }


def interval_coverage(result: dict, run: Path) -> dict:
    """Per test flight, the coverage of its fold's own intervals (calibrated on the fold's validation data,
    as a single run's are: its evaluation.json) and of the intervals calibrated across the other folds' test
    flights (crossval's, nested), with whether each falls short of the target beyond binomial noise."""
    from cloudml_lib.science.report import short_of_target

    target = result["intervals"]["coverage"]
    nested = result["intervals"]["nested"]["per_flight"]
    out = {}
    for name in result["folds"]:
        evaluation = json.loads((run / "folds" / name / "model" / "evaluation.json").read_text())
        own = ((evaluation.get("intervals") or {}).get("per_flight") or {}).get(name) or {}
        across = nested.get(name) or {}
        out[name] = {
            kind: {
                "coverage": got.get("coverage"),
                "mean_width_km": got.get("mean_width_km"),
                "n": got.get("n"),
                "short_beyond_noise": got.get("coverage") is not None
                and short_of_target(got["coverage"], got["n"], target),
            }
            for kind, got in (("own_validation", own), ("across_flights", across))
        }
    return out


def curves(result: dict) -> dict:
    """Per test flight, its adaptation curve as the summary reads it."""
    flights = {}
    for name, record in result["adaptation"]["per_flight"].items():
        flights[name] = {
            "gap_frames": record.get("gap_frames"),
            "scored_labels": record.get("scored_labels"),
            "left_out": record.get("left_out", {}),
            "curve": [
                {
                    "n": p["n"],
                    "network_mae_km": p["network"]["mae_km"],
                    "network_r2": p["network"]["r2"],
                    "best_baseline": p.get("best_baseline"),
                    "best_baseline_mae_km": (p["baselines"].get(p.get("best_baseline") or "") or {}).get(
                        "mae_km"
                    ),
                    "call": (p.get("against_best") or {}).get("call"),
                    "coverage": (p.get("intervals") or {}).get("coverage"),
                }
                for p in record["curve"]
            ],
        }
    return flights


def summarise(runs: list[dict]) -> dict:
    """Per N: the mean over flights of each seed, their mean and spread over seeds, and the calls counted."""
    out = {}
    for n in (0, *LABELS):
        points = [[p for f in r["flights"].values() for p in f["curve"] if p["n"] == n] for r in runs]
        if not any(points):
            continue

        def mean(key, pts):
            values = [p[key] for p in pts if p[key] is not None]
            return float(np.mean(values)) if values else None

        def spread(key, points=points):
            values = [v for v in (mean(key, pts) for pts in points if pts) if v is not None]
            return _spread(values) if values else None

        flat = [p for pts in points for p in pts]
        out[str(n)] = {
            "flight_seeds": len(flat),
            "network_mae_km": spread("network_mae_km"),
            "network_r2": spread("network_r2"),
            "best_baseline_mae_km": spread("best_baseline_mae_km"),
            "calls": {c: sum(p["call"] == c for p in flat) for c in ("better", "level", "worse")},
            "coverage": mean("coverage", flat),
        }
    return out


def interval_summary(runs: list[dict]) -> dict:
    """Per calibration: the mean coverage and width over flights and seeds, and the flight-seeds short of the
    target beyond binomial noise."""
    out = {}
    for kind in ("own_validation", "across_flights"):
        rows = [f[kind] for r in runs for f in r["intervals"].values() if f[kind]["coverage"] is not None]
        out[kind] = {
            "flight_seeds": len(rows),
            "mean_coverage": float(np.mean([r["coverage"] for r in rows])) if rows else None,
            "lowest_coverage": float(np.min([r["coverage"] for r in rows])) if rows else None,
            "mean_width_km": float(np.mean([r["mean_width_km"] for r in rows])) if rows else None,
            "short_beyond_noise": sum(r["short_beyond_noise"] for r in rows),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "adaptation.json"))
    args = p.parse_args()
    from cloudml_lib.data.synthetic import DEMO_VERSION
    from cloudml_lib.science.adapt import ADAPT_STEPS, ANCHOR, GAP_FLOOR_FRAMES

    seeds = [int(s) for s in args.seeds.split(",")]
    warmup = max(1, round(30 * args.epochs / 12))  # the demo's 30 steps over 12 epochs, scaled
    shutil.rmtree(SCRATCH, ignore_errors=True)
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        runs.append(one_run(seed, args.epochs, warmup))
        print(json.dumps({k: runs[-1][k] for k in ("seed", "seconds")}), flush=True)
    out = {
        "machine": machine(),
        "protocol": PROTOCOL
        + "; nested leave-one-flight-out cross-validation (crossval) with its adaptation",
        "config": "configs/demo.yaml",
        "demo_generator": DEMO_VERSION,
        "epochs": args.epochs,
        "labels": list(LABELS),
        "adaptation": {"steps": ADAPT_STEPS, "anchor": ANCHOR, "gap_floor_frames": GAP_FLOOR_FRAMES},
        "seeds": seeds,
        "summary": summarise(runs),
        "interval_target": 0.9,
        "intervals": interval_summary(runs),
        "runs": runs,
        "seconds": time.perf_counter() - t0,
    }
    Path(args.results).write_text(json.dumps(out, indent=1, default=lambda v: v.item()))  # numpy scalars
    shutil.rmtree(SCRATCH, ignore_errors=True)
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
