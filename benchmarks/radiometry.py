"""The network with and without radiometry against every baseline, each demo flight the test flight once.

    python benchmarks/radiometry.py      # writes benchmarks/results/radiometry.json (about 35 min on 2 cores)
    python benchmarks/radiometry.py --epochs 2 --seeds 42 --results /tmp/r.json   # a quick look

What a scientist checking the method asks first: does the network add anything over what the physics sees,
the cloud's brightness temperature? Measured by the nested cross-validation `crossval` runs (each of the five
demo flights of configs/demo.yaml, generator version 3, the test flight once; its best epoch and intervals
chosen on validation data drawn from its own training flights by data.validation: auto; nothing chosen on the
test flight), for each variant and seed:
- the network with `data.radiometry: none` (the frames' per-frame reading alone) and `statistics` (beside it,
  the labelled frame's brightness statistics on a scale fitted on the training part);
- the baselines of each fold (science/baselines.py, fitted on its training part): the training mean, a linear
  model and gradient-boosted trees on the raw brightness statistics and the sun's angles (they do not depend
  on the seed or the variant: the same numbers in every run);
- per fold the best baseline and the network's MAE skill against it (1 - MAE network / MAE baseline), and the
  spread of the validation R2 over the fold's last 3 epochs (how steady training is).
The CPU budget: 6 epochs per fold instead of the demo's 12 (warm-up 15 steps instead of 30) and no cloud
output (`model.cloud_head: none`: the height trains exactly as with the demo's probe, fitted only after
training), so the whole runs in about half an hour on a 2-core CPU; the demo's own run trains 12.

Summary per variant: the mean over folds of each seed, then their mean and spread over seeds; the folds on
which the best baseline does at least as well; each fold's test R2 spread over seeds. README's first paragraph
quotes this file.
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

SCRATCH = REPO / "benchmarks" / ".scratch" / "radiometry"
SEEDS = (42, 7, 1)
VARIANTS = ("none", "statistics")
METHODS = ("model", "mean", "linear", "trees")
LAST_EPOCHS = 3


def fold_epochs(run: Path) -> list[dict]:
    """A fold model's epoch records (metrics.jsonl)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "epoch"]


def demo_crossval(scratch: Path, name: str, setting: str, seed: int, epochs: int, warmup: int):
    """One nested cross-validation of the demo (configs/demo.yaml) in `scratch` with `setting` ("key=value"),
    on the CPU budget of the module's docstring: (its result, seconds, its folder)."""
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.crossval import crossval

    run = scratch / "runs" / name
    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [
            f"data.dir={scratch / 'flights'}",
            f"data.cache_dir={scratch / 'cache'}",
            setting,
            f"train.seed={seed}",
            f"train.epochs={epochs}",
            f"train.warmup_steps={warmup}",
            "model.cloud_head=none",  # the height is trained as with the probe; its fit is not timed here
        ],
    )
    t0 = time.perf_counter()
    result = crossval(cfg, run, controls=False)
    return result, time.perf_counter() - t0, run


def one_run(variant: str, seed: int, epochs: int, warmup: int) -> dict:
    """One cross-validation: every fold's numbers."""
    result, seconds, run = demo_crossval(
        SCRATCH, f"{variant}-{seed}", f"data.radiometry={variant}", seed, epochs, warmup
    )
    folds = {}
    for name, f in result["folds"].items():
        model = run / "folds" / name / "model"
        r2 = [e["r2"] for e in fold_epochs(model)]
        split = json.loads((model / "run.json").read_text()).get("split") or {}
        folds[name] = {
            **{m: {k: f[m][k] for k in ("r2", "mae_km", "bias_km", "n")} for m in METHODS if m in f},
            "best_baseline": f.get("best_baseline"),
            "validation": list(split.get("validation") or {}),
            "validation_r2_by_epoch": [round(v, 4) for v in r2],
            "validation_r2_spread_last_epochs": float(np.std(r2[-LAST_EPOCHS:])),
        }
    return {"variant": variant, "seed": seed, "seconds": round(seconds, 1), "folds": folds}


def summarise(runs: list[dict]) -> dict:
    """Per variant: the mean over folds of every method's R2 and MAE for each seed, their mean and spread over
    seeds, the mean skill against each fold's best baseline, the folds where a baseline does at least as well
    (in how many seeds), each fold's test R2 spread over seeds, and the mean spread of the validation R2 over
    the last epochs."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == variant]
        names = list(mine[0]["folds"])
        per_seed = {
            m: {
                k: [float(np.mean([r["folds"][n][m][k] for n in names])) for r in mine]
                for k in ("r2", "mae_km")
            }
            for m in METHODS
        }
        skill = [float(np.mean([r["folds"][n]["best_baseline"]["skill"] for n in names])) for r in mine]
        fold = lambda key, mine=mine, names=names: {n: [r["folds"][n][key] for r in mine] for n in names}  # noqa: E731
        out[variant] = {
            "mean_over_folds": {m: {k: _spread(v) for k, v in d.items()} for m, d in per_seed.items()},
            "skill_vs_best_baseline": _spread(skill),
            "baseline_at_least_as_good": {
                n: sum(b["skill"] <= 0 for b in v) for n, v in fold("best_baseline").items()
            },
            "best_baseline": {n: v[0]["name"] for n, v in fold("best_baseline").items()},
            "test_r2_spread_over_seeds": {
                n: float(np.std([m["r2"] for m in v])) for n, v in fold("model").items()
            },
            "validation_r2_spread_last_epochs": float(
                np.mean([x for v in fold("validation_r2_spread_last_epochs").values() for x in v])
            ),
            "seconds": float(np.sum([r["seconds"] for r in mine])),
        }
    return out


def _spread(values: list[float]) -> dict:
    return {"mean": float(np.mean(values)), "spread_over_seeds": float(np.std(values))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--results", default=str(REPO / "benchmarks" / "results" / "radiometry.json"))
    args = p.parse_args()
    from cloudml_lib.data.synthetic import DEMO_VERSION

    seeds = [int(s) for s in args.seeds.split(",")]
    warmup = max(1, round(30 * args.epochs / 12))  # the demo's 30 steps over 12 epochs, scaled
    shutil.rmtree(SCRATCH, ignore_errors=True)
    t0 = time.perf_counter()
    runs = []
    for seed in seeds:
        for variant in VARIANTS:
            runs.append(one_run(variant, seed, args.epochs, warmup))
            print(json.dumps({k: runs[-1][k] for k in ("variant", "seed", "seconds")}), flush=True)
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
    }
    Path(args.results).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.results}")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
