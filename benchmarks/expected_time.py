"""The first expected time against what the epochs take: is the picker's estimate within 25 %?

    python benchmarks/expected_time.py          # writes benchmarks/results/expected_time.json (~5 min, CPU)
    python benchmarks/expected_time.py --smoke  # 2 tiny epochs: checks the code path, writes nothing

The expectation is made as the picker makes it before a run (core/machine/timing.py: steps timed at the run's
own batch, warm-up steps left out, in the run's memory format; colab/expected.py: an epoch is its training
steps plus its validation forwards, counted from the cache), from the timed steps alone: nothing of the run
is used but its structure (steps per epoch, validation batches). Then the run trains (the real command, in a
process of its own) and its run.json says what each epoch took. Reported: the expected epoch against the
median epoch (all of them, and leaving out the first, which also starts the loader and allocates).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "expected_time.json"
SCRATCH = REPO / "benchmarks" / ".scratch" / "expected_time"
WITHIN = 0.25


def expected_epoch(cfg, run_info: dict, step) -> tuple[float, int, int]:
    """(the expected epoch's seconds, training steps, validation batches) as the picker counts them."""
    from cloudml_lib.colab.drive import cached_samples
    from cloudml_lib.core.machine.timing import Expected
    from cloudml_lib.core.network.inference import eval_batch_size
    from cloudml_lib.data.splits import counts_by_role

    train, val = counts_by_role(cached_samples(cfg), cfg.data)
    val_batches = math.ceil(val * cfg.train.quick_val_fraction / eval_batch_size(cfg.train.batch_size))
    steps = int(run_info["steps_per_epoch"])
    return Expected(step, steps, val_batches, cfg.train.epochs).epoch_s, steps, val_batches


def main(argv=None) -> int:
    import torch

    from cloudml_lib.base.config import derive, load_config
    from cloudml_lib.commands.presets import preset_config_path
    from cloudml_lib.core.machine import estimate
    from cloudml_lib.core.machine.timing import timed
    from cloudml_lib.data.synthetic import make_demo_flights

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 tiny epochs; writes nothing")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    shutil.rmtree(SCRATCH, ignore_errors=True)
    flights = SCRATCH / "flights"
    frames_each = 120 if args.smoke else 400
    make_demo_flights(flights, n_flights=3 if args.smoke else 5, frames_per_flight=frames_each)
    epochs = 2 if args.smoke else 6
    over = {"data.dir": str(flights), "data.cache_dir": str(SCRATCH / "cache"), "train.epochs": epochs}
    cfg = derive(load_config(preset_config_path("demo")), over)
    frame = (cfg.data.swath_slice[1] - cfg.data.swath_slice[0], 96)
    step = timed(estimate.StepShape.of(cfg, None, frame=frame), cfg.train.batch_size, torch.device("cpu"))
    run = SCRATCH / "run"
    sets = [f"--set={k}={json.dumps(v) if isinstance(v, list) else v}" for k, v in over.items()]
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cloudml_lib", "train", "--preset", "demo", "--run-dir", str(run), *sets],
        cwd=REPO,
        check=True,
        env=dict(os.environ, CLOUDML_EXPECTED=json.dumps({"step_s": step.seconds, "source": step.source})),
        stdout=subprocess.DEVNULL,
    )
    info = json.loads((run / "run.json").read_text())
    epoch_s, steps, val_batches = expected_epoch(cfg, info, step)
    each = info["measured"]["each_epoch_s"]
    out = {
        "machine": machine(),
        "config": f"configs/demo.yaml, {epochs} epochs, on demo flights of {frames_each} frames",
        "epochs": epochs,
        "timed_step_s": step.seconds,
        "timed_source": step.source,
        "steps_per_epoch": steps,
        "validation_batches": val_batches,
        "expected_epoch_s": epoch_s,
        "measured_epoch_s": each,
        "expected_over_median": epoch_s / statistics.median(each),
        "expected_over_median_after_first": epoch_s / statistics.median(each[1:]) if len(each) > 1 else None,
        "within": WITHIN,
        "run_s": time.perf_counter() - t0,
    }
    out["within_25_percent"] = abs(out["expected_over_median"] - 1) <= WITHIN
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    if not args.smoke:
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
