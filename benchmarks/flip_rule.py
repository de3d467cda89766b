"""Does the flip rule matter? Test-flight error of the demo run with the old and the new azimuth flip.

    python benchmarks/flip_rule.py           # writes benchmarks/results/flip_rule.json (about 5 minutes)

The demo flights turn (their heading changes along each flight) and their shadows fall in the direction
of the sun azimuth relative to the heading, as a real camera's would. Variants, each the full demo run
(configs/demo.yaml, the same flights, the same test flight), side by side in one process:
- `old_rule`: the network sees the ground azimuth and a flip maps it to 360 - a (the rule before
  issue 17: right only when the aircraft heads north), so half the flipped samples teach a wrong
  shadow direction;
- `ground_heading`: the ground azimuth, flipped to 2 * heading - a (consistent);
- `relative`: the azimuth relative to the heading, flipped to -r (the default);
- `no_flip`: the default without any flip, as a reference.
By default only `old_rule` and `relative` run, with one seed (RUNS below lists the others); the numbers
are what the runs gave, noise included.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import PROTOCOL, machine  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "flip_rule"
RUNS = (("old_rule", 42), ("relative", 42))  # add ("old_rule", 7), ("relative", 7), ("ground_heading", 42),
# ("no_flip", 42) for the full comparison (about 10 more minutes); results/flip_rule.json holds the two above


def run(variant: str, seed: int) -> dict:
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.runs import train_run as train
    from cloudml_lib.data import dataset as ds_mod

    overrides = [
        f"data.dir={SCRATCH / 'flights'}",
        f"data.cache_dir={SCRATCH / 'cache'}",
        f"train.seed={seed}",
        f"data.sun_azimuth={'relative' if variant in ('relative', 'no_flip') else 'ground'}",
    ]
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides)
    saved = ds_mod.mirror_line, ds_mod.FLIP_PROB
    if variant == "old_rule":  # 360 - a: a mirror line at 0 degrees from north
        ds_mod.mirror_line = lambda heading, mode, axis: np.zeros(np.shape(heading))
    if variant == "no_flip":
        ds_mod.FLIP_PROB = 0.0
    try:
        t0 = time.perf_counter()
        result = train(cfg, SCRATCH / "runs" / f"{variant}-{seed}", resume="never")
        seconds = time.perf_counter() - t0
    finally:
        ds_mod.mirror_line, ds_mod.FLIP_PROB = saved
    overall = result["overall"]
    return {
        "variant": variant,
        "seed": seed,
        "seconds": round(seconds, 1),
        **{k: overall[k] for k in ("r2", "mae_km", "rmse_km", "bias_km")},
    }


def main() -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)
    rows = []
    for variant, seed in RUNS:
        rows.append(run(variant, seed))
        print(json.dumps(rows[-1]), flush=True)
    mean = {
        v: {k: float(np.mean([r[k] for r in rows if r["variant"] == v])) for k in ("r2", "mae_km", "rmse_km")}
        for v in dict.fromkeys(r["variant"] for r in rows)
    }
    out = {
        "machine": machine(),
        "protocol": PROTOCOL,
        "config": "configs/demo.yaml",
        "runs": rows,
        "mean_by_variant": mean,
        "old_over_new_rmse": mean["old_rule"]["rmse_km"] / mean["relative"]["rmse_km"],
    }
    path = REPO / "benchmarks" / "results" / "flip_rule.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
