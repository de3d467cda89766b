"""The network with and without the flight's atmosphere against every baseline, each demo flight tested once.

    python benchmarks/atmosphere.py      # writes benchmarks/results/atmosphere.json (about 40 min on 2 cores)
    python benchmarks/atmosphere.py --epochs 2 --seeds 42 --results /tmp/a.json   # a quick look

The question a boundary-layer meteorologist asks first: on a flight never seen, do the frames add anything to
what the flight's atmosphere (ERA5) already says of the cloud base? Measured by the nested cross-validation
`crossval` runs (each of the five demo flights of configs/demo.yaml, generator version 4 with its ERA5 files,
the test flight once; its best epoch and intervals chosen on validation data drawn from its own training
flights by data.validation: auto; nothing chosen on the test flight), for each setting and seed:
- the network with `data.atmosphere: none` (the frames, the sun and the brightness statistics), `alone` (the
  ERA5 predictors and the sun, no frames) and `with_frames` (both);
- the baselines of each fold (science/baselines.py, fitted on its training part; they do not depend on the
  seed or the setting): the training mean, linear and trees on the brightness statistics, the physical
  retrievals with no fitted parameter, trees on the atmosphere alone and on the atmosphere with the
  brightness statistics.
The CPU budget: 6 epochs per fold instead of the demo's 12 (warm-up scaled) and no cloud output
(`model.cloud_head: none`: the height trains exactly as with the demo's probe), so the whole runs in under 45
minutes on a 2-core CPU.

Summary per setting: the mean over folds of each seed, then their mean and spread over seeds; per flight the
best method that reads no frame (the network on the atmosphere alone, the physical retrieval, the atmosphere's
trees) against the best that reads them (the network with frames, the cold-top retrieval, the trees on
atmosphere and brightness), and in how many seeds the frames add nothing. README's first paragraph quotes
this file.
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
from benchmarks.radiometry import LAST_EPOCHS, _spread, demo_crossval, fold_epochs  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "atmosphere"
SEEDS = (42, 7, 1)
SETTINGS = ("none", "alone", "with_frames")
KEYS = ("r2", "mae_km", "bias_km", "n")


def one_run(setting: str, seed: int, epochs: int, warmup: int) -> dict:
    """One cross-validation: every fold's numbers, the network's and each baseline's."""
    from cloudml_lib.science.baselines import BASELINES

    result, seconds, run = demo_crossval(
        SCRATCH, f"{setting}-{seed}", f"data.atmosphere={setting}", seed, epochs, warmup
    )
    folds = {}
    for name, f in result["folds"].items():
        model = run / "folds" / name / "model"
        r2 = [e["r2"] for e in fold_epochs(model)]
        methods = [m for m in ("model", *BASELINES) if isinstance(f.get(m), dict) and "mae_km" in f[m]]
        folds[name] = {
            **{m: {k: f[m][k] for k in KEYS if k in f[m]} for m in methods},
            "best_baseline": f.get("best_baseline"),
            "validation_r2_spread_last_epochs": float(np.std(r2[-LAST_EPOCHS:])),
        }
    return {"setting": setting, "seed": seed, "seconds": round(seconds, 1), "folds": folds}


# what reads no frame, and what reads them (the network's settings as "network <setting>")
FRAMELESS = ("network alone", "physical", "atmosphere_trees")
# cold_top reads the frame's coldest pixels: it sees the frames
WITH_FRAMES = (
    "network none",
    "network with_frames",
    "cold_top",
    "atmosphere_brightness_trees",
    "linear",
    "trees",
)


def method_maes(runs: list[dict], seed: int, flight: str) -> dict[str, float]:
    """Every method's test MAE on `flight` with `seed`: the network per setting, the baselines once."""
    out = {}
    for r in runs:
        if r["seed"] != seed or flight not in r["folds"]:
            continue
        fold = r["folds"][flight]
        out[f"network {r['setting']}"] = fold["model"]["mae_km"]
        for m, v in fold.items():
            if m not in ("model", "best_baseline") and isinstance(v, dict) and "mae_km" in v:
                out.setdefault(m, v["mae_km"])
    return out


def images_verdict(runs: list[dict]) -> dict:
    """Per flight and seed: the best method that reads no frame against the best that reads them; in how many
    seeds the frames add nothing (the frameless best at least as good)."""
    seeds = sorted({r["seed"] for r in runs})
    flights = list(runs[0]["folds"])
    out = {}
    for flight in flights:
        rows = []
        for seed in seeds:
            maes = method_maes(runs, seed, flight)
            frameless = {m: v for m, v in maes.items() if m in FRAMELESS and v is not None}
            framed = {m: v for m, v in maes.items() if m in WITH_FRAMES and v is not None}
            if not frameless or not framed:
                continue
            a, b = min(frameless, key=frameless.get), min(framed, key=framed.get)
            rows.append({"seed": seed, "frameless": [a, frameless[a]], "with_frames": [b, framed[b]]})
        out[flight] = {
            "by_seed": rows,
            "frames_add_nothing_in_seeds": sum(r["frameless"][1] <= r["with_frames"][1] for r in rows),
        }
    return out


def summarise(runs: list[dict]) -> dict:
    """Per setting: every method's R2 and MAE, mean over folds per seed, their mean and spread over seeds; the
    network's skill against each fold's best baseline; each fold's test MAE spread over seeds."""
    out = {}
    for setting in dict.fromkeys(r["setting"] for r in runs):
        mine = [r for r in runs if r["setting"] == setting]
        names = list(mine[0]["folds"])
        methods = [m for m in mine[0]["folds"][names[0]] if m != "best_baseline" and "spread" not in m]
        per_seed = {
            m: {
                k: [float(np.mean([r["folds"][n][m][k] for n in names])) for r in mine]
                for k in ("r2", "mae_km")
            }
            for m in methods
            if all(m in r["folds"][n] for r in mine for n in names)
        }
        skill = [
            float(np.mean([(r["folds"][n]["best_baseline"] or {}).get("skill") or 0.0 for n in names]))
            for r in mine
        ]
        out[setting] = {
            "mean_over_folds": {m: {k: _spread(v) for k, v in d.items()} for m, d in per_seed.items()},
            "skill_vs_best_baseline": _spread(skill),
            "best_baseline": {n: (mine[0]["folds"][n]["best_baseline"] or {}).get("name") for n in names},
            "test_mae_spread_over_seeds": {
                n: float(np.std([r["folds"][n]["model"]["mae_km"] for r in mine])) for n in names
            },
            "seconds": float(np.sum([r["seconds"] for r in mine])),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "atmosphere.json"))
    args = p.parse_args()
    from cloudml_lib.data.synthetic import DEMO_VERSION

    seeds = [int(s) for s in args.seeds.split(",")]
    warmup = max(1, round(30 * args.epochs / 12))  # the demo's 30 steps over 12 epochs, scaled
    shutil.rmtree(SCRATCH, ignore_errors=True)
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        for setting in args.settings.split(","):
            runs.append(one_run(setting, seed, args.epochs, warmup))
            print(json.dumps({k: runs[-1][k] for k in ("setting", "seed", "seconds")}), flush=True)
    out = {
        "machine": machine(),
        "protocol": PROTOCOL + "; nested leave-one-flight-out cross-validation (crossval)",
        "config": "configs/demo.yaml",
        "demo_generator": DEMO_VERSION,
        "epochs": args.epochs,
        "warmup_steps": warmup,
        "seeds": seeds,
        "minutes": round((time.perf_counter() - t0) / 60, 1),
        "runs": runs,
        "summary": summarise(runs),
        "images": images_verdict(runs),
    }
    Path(args.results).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.results}")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
