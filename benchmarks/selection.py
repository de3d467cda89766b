"""The optimism of choosing on the test flight: what CloudML 0.2 reported against an untouched test.

    python benchmarks/selection.py         # writes benchmarks/results/selection.json (about 10 minutes)

CloudML 0.2 validated on its held-out flight: the best epoch (and the intervals' calibration) were chosen on
the flight it then reported as held out. Since 0.3 validation data come from the training flights and the
test flight is untouched (data/splits.py). Measured on the demo (configs/demo.yaml: five flights, 05Mar25 the
test flight, a whole training flight validating), over seeds, each run keeping every epoch's weights:

- `untouched`: the test flight's R2 and MAE of the epoch the validation data chose (what a run reports now);
- `chosen_on_test`: the same trajectory's epoch chosen as 0.2 chose it, by the loss on a fixed share of the
  test flight (train.quick_val_fraction), and its R2 and MAE there: the number 0.2 would have reported;
- `optimism`: chosen_on_test minus untouched (R2), per seed and its mean;
- every epoch's test R2 (its spread is what choosing on it exploits), and the 90% intervals' coverage on the
  test flight, calibrated on the validation data (measured) and on the test flight itself (0.2's, near 90% by
  construction).

Both numbers come from one training per seed, on the same three training flights (0.2 trained on the
validation flight too): what differs is only where the choosing happened. The first seed (42) is the demo's
own run (`python -m cloudml_lib train --config configs/demo.yaml`): README's first paragraph quotes it.
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

SCRATCH = REPO / "benchmarks" / ".scratch" / "selection"
SEEDS = (42, 7, 1)
KEEP_EVERY_EPOCH = [
    "checkpoint.keep_last=100",
    "checkpoint.every_steps=1000000",
    "checkpoint.every_minutes=10000",
]


def scores(model, cfg, dataset, indices=None) -> dict:
    """The model's loss (the training objective) and metrics in km on `dataset`'s samples with a height."""
    from cloudml_lib.core.machine.device import choose_device
    from cloudml_lib.core.network.inference import predict
    from cloudml_lib.core.network.metrics import Scored, regression_metrics
    from cloudml_lib.train.loss import validation_loss

    has = dataset.has_height()
    rows = np.flatnonzero(has) if indices is None else indices
    out, target = predict(model, dataset, choose_device("cpu"), 64, indices=rows)
    out = {k: None if v is None else v.astype(np.float64) for k, v in out.items()}
    km = Scored.from_outputs(out, dataset.scalers).height_km
    flags = dataset.cloud_flags()[rows]
    loss = validation_loss(out, target.astype(np.float64), np.ones(len(rows), bool), flags, cfg)
    return {
        "loss": loss,
        "pred_km": km,
        "true_km": dataset.targets_km()[rows],
        **regression_metrics(dataset.targets_km()[rows], km),
    }


def coverage(cal_pred, cal_true, pred, true, coverage: float = 0.9) -> float | None:
    from cloudml_lib.science import intervals

    cal = intervals.calibrate(cal_pred, cal_true, "conformal_absolute", coverage, "benchmark")
    return None if cal is None else intervals.scores(true, *intervals.bounds(pred, cal))["coverage"]


def one_seed(seed: int) -> dict:
    from cloudml_lib.base.config import config_from_dict, load_config
    from cloudml_lib.commands.runs import train_run
    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.core.run.checkpoint import Key, load_checkpoint
    from cloudml_lib.data.dataset import Scalers, quick_subset
    from cloudml_lib.science.evaluate import load_end_data

    run = SCRATCH / "runs" / f"seed-{seed}"
    overrides = [
        f"data.dir={SCRATCH / 'flights'}",
        f"data.cache_dir={SCRATCH / 'cache'}",
        f"train.seed={seed}",
    ]
    t0 = time.perf_counter()
    report = train_run(load_config(REPO / "configs" / "demo.yaml", overrides + KEEP_EVERY_EPOCH), run)
    seconds = time.perf_counter() - t0
    best = load_checkpoint(run / "best.pt")
    cfg = config_from_dict(best[Key.CONFIG])
    scalers = Scalers.from_dict(best[Key.SCALERS])
    data = load_end_data(cfg, scalers, best.get(Key.PROVENANCE))
    test_rows = np.flatnonzero(data.test_set.has_height())
    quick = test_rows[quick_subset(len(test_rows), cfg.train.quick_val_fraction)]  # 0.2's per-epoch subset
    epochs = []
    for folder in sorted((run / "checkpoints").glob("step-*")):
        state = load_checkpoint(folder / "state.pt")
        model = build_model(cfg, scalers)
        # the weights the run validates: the average where it keeps one (train.ema_decay)
        model.load_state_dict((state.get(Key.EMA) or {}).get("weights") or state[Key.MODEL])
        test, on_quick = scores(model, cfg, data.test_set), scores(model, cfg, data.test_set, quick)
        val = scores(model, cfg, data.val_set)
        epochs.append(
            {
                "epoch": int(state[Key.LOOP]["epoch"]),
                "test_r2": test["r2"],
                "test_mae_km": test["mae_km"],
                "test_quick_loss": on_quick["loss"],
                "validation_loss": val["loss"],
                "_test": test,
                "_val": val,
            }
        )
    chosen = min(epochs, key=lambda e: (e["test_quick_loss"], e["epoch"]))  # 0.2: the held-out flight chose
    untouched = next(e for e in epochs if e["epoch"] == report["best_epoch"])  # 0.3: the validation data
    row = {
        "seed": seed,
        "seconds": round(seconds, 1),
        "best_epoch_untouched": untouched["epoch"],
        "best_epoch_chosen_on_test": chosen["epoch"],
        "untouched": {"r2": untouched["test_r2"], "mae_km": untouched["test_mae_km"]},
        "chosen_on_test": {"r2": chosen["test_r2"], "mae_km": chosen["test_mae_km"]},
        "optimism_r2": chosen["test_r2"] - untouched["test_r2"],
        "optimism_mae_km": untouched["test_mae_km"] - chosen["test_mae_km"],
        "reported": {k: report["overall"][k] for k in ("r2", "mae_km", "rmse_km", "bias_km", "n")},
        "baseline": {k: report["baseline"][k] for k in ("r2", "mae_km")},
        "mae_interval_km": next(iter(report["mae_interval_km"].values())),
        "epoch_test_r2": [round(e["test_r2"], 4) for e in epochs],
        "interval_coverage_on_test": {
            "calibrated_on_validation": coverage(
                untouched["_val"]["pred_km"], untouched["_val"]["true_km"], untouched["_test"]["pred_km"],
                untouched["_test"]["true_km"],
            ),
            "calibrated_on_the_test_flight": coverage(
                chosen["_test"]["pred_km"], chosen["_test"]["true_km"], chosen["_test"]["pred_km"],
                chosen["_test"]["true_km"],
            ),
        },
        "cloud": {
            m: {k: report["cloud"][m]["overall"][k] for k in ("accuracy", "roc_auc")}
            for m in ("model", "majority", "bt_threshold")
            if m in report["cloud"]
        },
        "split": report["protocol"]["words"],
    }  # fmt: skip
    assert (
        untouched["epoch"] == report["best_epoch"]
        and abs(untouched["test_r2"] - report["overall"]["r2"]) < 1e-4
    )
    return row


def main() -> None:
    from cloudml_lib.data.synthetic import DEMO_VERSION

    shutil.rmtree(SCRATCH, ignore_errors=True)
    rows = []
    for seed in SEEDS:
        rows.append(one_seed(seed))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "epoch_test_r2"}), flush=True)
    optimism = [r["optimism_r2"] for r in rows]
    out = {
        "machine": machine(),
        "protocol": PROTOCOL,
        "config": "configs/demo.yaml",
        "demo_generator": DEMO_VERSION,
        "seeds": list(SEEDS),
        "runs": rows,
        "mean_optimism_r2": float(np.mean(optimism)),
        "std_optimism_r2": float(np.std(optimism)),
        "mean_untouched_r2": float(np.mean([r["untouched"]["r2"] for r in rows])),
        "mean_chosen_on_test_r2": float(np.mean([r["chosen_on_test"]["r2"] for r in rows])),
    }
    path = REPO / "benchmarks" / "results" / "selection.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    shutil.rmtree(SCRATCH, ignore_errors=True)


if __name__ == "__main__":
    main()
