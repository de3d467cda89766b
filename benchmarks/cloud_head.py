"""How to give the model a cloud / no-cloud output: measured on the demo.

    python benchmarks/cloud_head.py           # writes benchmarks/results/cloud_head.json (about 20 minutes)

Variants, each the full demo run (configs/demo.yaml, the same flights, the same test flight),
one after the other in one process:
- `probe` (the default, model.cloud_head: probe): the height network trained alone, then a logistic
  regression on its features fitted on every matched frame of the training flights when training ends;
- `joint` (model.cloud_head: joint): one network with a height and a cloud output trained together
  (train.cloud_loss_weight 0.5) on every matched frame;
- `height_only` (model.cloud_head: none): the height network alone, no cloud output;
- `cloud_only` (joint with train.height_loss_weight 0): the same network trained on cloud / no-cloud
  alone, the "second model" that would sit beside `height_only`.
Compared: the test flight's height error (probe and joint against height_only), the test flight's cloud
accuracy, F1 and ROC-AUC (against each other and the brightness-temperature threshold), and the time: the
probe's whole run against height_only's, the joint model's epochs against two separate models'. probe, joint
and height_only are repeated with a second seed (the demo's test error moves with the seed).
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

SCRATCH = REPO / "benchmarks" / ".scratch" / "cloud_head"
VARIANTS = {
    "probe": ["model.cloud_head=probe"],
    "joint": ["model.cloud_head=joint"],
    "height_only": ["model.cloud_head=none"],
    "cloud_only": ["model.cloud_head=joint", "train.height_loss_weight=0"],
}
# the first run also writes the demo flights and builds the caches: joint, compared by its epochs' time only
RUNS = (
    ("joint", 42),
    ("height_only", 42),
    ("probe", 42),
    ("cloud_only", 42),
    ("joint", 7),
    ("height_only", 7),
    ("probe", 7),
)


def run(variant: str, seed: int) -> dict:
    from cloudml_lib.base.config import load_config
    from cloudml_lib.commands.runs import train_run as train

    overrides = [
        f"data.dir={SCRATCH / 'flights'}",
        f"data.cache_dir={SCRATCH / 'cache'}",
        f"train.seed={seed}",
        *VARIANTS[variant],
    ]
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides)
    t0 = time.perf_counter()
    report = train(cfg, SCRATCH / "runs" / f"{variant}-{seed}", resume="never")
    seconds = time.perf_counter() - t0
    cloud = report.get("cloud") or {}
    metrics = (SCRATCH / "runs" / f"{variant}-{seed}" / "metrics.jsonl").read_text().splitlines()
    epochs = sum(r.get("time_s", 0.0) for r in map(json.loads, metrics) if r.get("kind") == "epoch")
    # seconds: the whole run (the first one also writes the demo flights and builds the caches);
    # epoch_seconds: training and validation only, what the comparison of times uses
    row = {
        "variant": variant,
        "seed": seed,
        "seconds": round(seconds, 1),
        "epoch_seconds": round(epochs, 1),
        **{k: report["overall"][k] for k in ("r2", "mae_km", "rmse_km")},
    }
    for method in ("model", "bt_threshold", "majority"):
        if method in cloud:
            row[f"cloud_{method}"] = {k: cloud[method]["overall"][k] for k in ("accuracy", "f1", "roc_auc")}
    return row


def main() -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)
    rows = {}
    for variant, seed in RUNS:
        rows[f"{variant}-{seed}"] = run(variant, seed)
        print(json.dumps(rows[f"{variant}-{seed}"]), flush=True)
    j, h, c, p = rows["joint-42"], rows["height_only-42"], rows["cloud_only-42"], rows["probe-42"]
    mae = {
        v: float(np.mean([r["mae_km"] for r in rows.values() if r["variant"] == v]))
        for v in ("probe", "joint", "height_only")
    }
    out = {
        "machine": machine(),
        "protocol": PROTOCOL,
        "config": "configs/demo.yaml",
        "runs": rows,
        "mean_mae_km": mae,
        "height_mae_probe_over_height_only": mae["probe"] / mae["height_only"],
        "height_mae_joint_over_height_only": mae["joint"] / mae["height_only"],
        "cloud_accuracy_probe_minus_joint": p["cloud_model"]["accuracy"] - j["cloud_model"]["accuracy"],
        "cloud_accuracy_joint_minus_cloud_only": j["cloud_model"]["accuracy"] - c["cloud_model"]["accuracy"],
        "time_probe_over_height_only": p["seconds"] / h["seconds"],
        "time_joint_over_two_models": j["epoch_seconds"] / (h["epoch_seconds"] + c["epoch_seconds"]),
    }
    path = REPO / "benchmarks" / "results" / "cloud_head.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
