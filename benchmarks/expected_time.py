"""The first expected time against what the epochs take: is the picker's estimate within 25 %?

    python benchmarks/expected_time.py          # writes benchmarks/results/expected_time.json (~3 min, CPU)
    python benchmarks/expected_time.py --smoke  # 2 small epochs, 2 estimates: the code path; writes nothing

The demo as its users get it: `make_demo_flights`'s default flights and configs/demo.yaml unchanged. The
expectation is made as the picker makes it before a run (core/machine/timing.py: steps timed at the run's own
batch, warm-up steps left out, in the run's memory format; colab/expected.py: an epoch is its training steps
plus its validation forwards, counted from the cache), from the timed steps alone: nothing of the run is used
but its structure (steps per epoch, validation batches). A user meets one estimate, made in a fresh kernel, so
it is made REPEATS times, each in a fresh process, and every one of them is reported: the spread is the point.
Then the run trains (the real command, in a process of its own) and its run.json says what each epoch took.
Reported: each expected epoch against the median epoch (all of them, and leaving out the first, which also
starts the loader and allocates).
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
REPEATS = 5


def demo_config(smoke: bool):
    """configs/demo.yaml on flights written here (`smoke`: 3 small flights, 2 epochs); (config, overrides)."""
    from cloudml_lib.base.config import derive, load_config
    from cloudml_lib.commands.presets import preset_config_path

    over = {"data.dir": str(SCRATCH / "flights"), "data.cache_dir": str(SCRATCH / "cache")}
    if smoke:
        over["train.epochs"] = 2
    return derive(load_config(preset_config_path("demo")), over), over


def time_step(smoke: bool) -> dict:
    """One estimate of a step, as the picker makes it in a fresh kernel."""
    import torch

    from cloudml_lib.core.machine import estimate
    from cloudml_lib.core.machine.timing import timed
    from cloudml_lib.data.synthetic import DEMO_FRAME_SHAPE

    torch.set_num_threads(2)
    cfg, _ = demo_config(smoke)
    frame = (cfg.data.swath_slice[1] - cfg.data.swath_slice[0], DEMO_FRAME_SHAPE[1])
    step = timed(estimate.StepShape.of(cfg, None, frame=frame), cfg.train.batch_size, torch.device("cpu"))
    return {"step_s": step.seconds, "source": step.source}


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
    from cloudml_lib.core.machine.timing import StepTime
    from cloudml_lib.data.synthetic import DEMO_FRAME_SHAPE, DEMO_FRAMES, make_demo_flights

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="2 tiny epochs, 2 estimates; writes nothing")
    p.add_argument("--time-step", action="store_true", help=argparse.SUPPRESS)  # one estimate, as JSON
    args = p.parse_args(argv)
    if args.time_step:
        print(json.dumps(time_step(args.smoke)))
        return 0
    shutil.rmtree(SCRATCH, ignore_errors=True)
    if args.smoke:
        make_demo_flights(SCRATCH / "flights", n_flights=3, frames_per_flight=300)
    else:
        make_demo_flights(SCRATCH / "flights")
    cfg, over = demo_config(args.smoke)
    estimates = []
    for _ in range(2 if args.smoke else REPEATS):
        out = subprocess.run(
            [sys.executable, __file__, "--time-step", *(["--smoke"] if args.smoke else [])],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        )
        estimates.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = estimates[0]
    run = SCRATCH / "run"
    sets = [f"--set={k}={v}" for k, v in over.items()]
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "cloudml_lib", "train", "--preset", "demo", "--run-dir", str(run), *sets],
        cwd=REPO,
        check=True,
        env=dict(os.environ, CLOUDML_EXPECTED=json.dumps(first)),
        stdout=subprocess.DEVNULL,
    )
    run_s = time.perf_counter() - t0
    info = json.loads((run / "run.json").read_text())
    each = info["measured"]["each_epoch_s"]
    median, after = statistics.median(each), statistics.median(each[1:]) if len(each) > 1 else None
    for e in estimates:
        step = StepTime(e["step_s"], e["source"], measured=True)
        e["expected_epoch_s"], steps, val_batches = expected_epoch(cfg, info, step)
        e["expected_over_median"] = e["expected_epoch_s"] / median
        e["expected_over_median_after_first"] = e["expected_epoch_s"] / after if after else None
    ratios = [e["expected_over_median"] for e in estimates]
    frames = 300 if args.smoke else DEMO_FRAMES
    out = {
        "machine": machine(),
        "config": f"configs/demo.yaml, {cfg.train.epochs} epochs, on {'3 small' if args.smoke else 'the 5'} "
        f"demo flights of {frames} frames of {DEMO_FRAME_SHAPE[0]} x {DEMO_FRAME_SHAPE[1]}",
        "epochs": cfg.train.epochs,
        "repeats": len(estimates),
        "estimates": estimates,
        "steps_per_epoch": steps,
        "validation_batches": val_batches,
        "measured_epoch_s": each,
        "median_epoch_s": median,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "within": WITHIN,
        "run_s": run_s,
        "within_25_percent": all(abs(r - 1) <= WITHIN for r in ratios),
    }
    print(json.dumps({k: v for k, v in out.items() if k != "machine"}, indent=1))
    if not args.smoke:
        RESULTS.write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {RESULTS.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
