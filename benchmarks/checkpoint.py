"""What checkpointing costs: stall per save, overhead of a whole run, and time to resume.

    python benchmarks/checkpoint.py          # writes benchmarks/results/checkpoint.json

1. Stall per save: the time the training loop waits for one checkpoint, asynchronous (snapshot to
   CPU memory, then commit in a background thread) against synchronous (snapshot and commit
   before training goes on), for the full-width model (64/128/256, ~0.5 M parameters + AdamW state).
2. Overhead: a complete demo training run with `checkpoint.every_steps=100` (plus the epoch-end
   and final saves); the sum of the loop's stalls over the run's wall time, and, side by side, the
   wall time of the same run with only the unavoidable epoch-end and final saves.
3. Resume start-up: process start to the first optimizer step, for a fresh start and for resumes
   early and late in an epoch (the run is SIGKILLed there first). Each is the median of 3 runs.
All on this machine's local disk; on Google Drive the background commit takes longer, which the
asynchronous path hides from the loop as long as a commit finishes within one checkpoint interval.
"""

from __future__ import annotations

import json
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

SCRATCH = REPO / "benchmarks" / ".scratch" / "checkpoint"
DEMO_DATA = [f"data.dir={SCRATCH / 'flights'}", f"data.cache_dir={SCRATCH / 'cache'}"]


def demo_config(*overrides: str):
    from cloudml_lib.base.config import load_config

    return load_config(REPO / "configs" / "demo.yaml", [*DEMO_DATA, *overrides])


def stall_per_save(n: int = 10) -> dict:
    from cloudml_lib.core.network.model import count_parameters
    from cloudml_lib.core.run.checkpoint import find_checkpoints
    from cloudml_lib.core.run.folder import RunFolder
    from cloudml_lib.train import Trainer

    run = SCRATCH / "stall"
    shutil.rmtree(run, ignore_errors=True)
    trainer = Trainer(demo_config("model.channels=[]", "checkpoint.keep_last=2"), run).setup()
    batches = iter(trainer.loader)
    for _ in range(3):  # AdamW state exists after a step
        trainer.train_step(next(batches))
        trainer.optimizer_step()
    asynchronous, synchronous = [], []
    for _ in range(n):
        trainer.progress.step += 1
        asynchronous.append(trainer.checkpoints.save("bench"))
        trainer.checkpoints.wait()  # measure each save alone
        trainer.progress.step += 1
        synchronous.append(trainer.checkpoints.save("bench", wait=True))
    size = (find_checkpoints(RunFolder(run))[0] / "state.pt").stat().st_size
    params = count_parameters(trainer.model)
    trainer.close()
    return {
        "parameters": params,
        "checkpoint_mb": size / 1e6,
        "saves": n,
        "async_stall_ms_median": 1e3 * statistics.median(asynchronous),
        "sync_stall_ms_median": 1e3 * statistics.median(synchronous),
        "async_stall_ms_max": 1e3 * max(asynchronous),
        "sync_stall_ms_max": 1e3 * max(synchronous),
        "sync_over_async": statistics.median(synchronous) / statistics.median(asynchronous),
    }


def run_overhead() -> dict:
    from cloudml_lib.train import Trainer

    out = {}
    for name, overrides in (
        ("every_steps_100", ["checkpoint.every_steps=100"]),
        ("epoch_end_only", ["checkpoint.every_steps=10000000", "checkpoint.every_minutes=10000"]),
    ):
        run = SCRATCH / f"overhead-{name}"
        shutil.rmtree(run, ignore_errors=True)
        trainer = Trainer(demo_config(*overrides), run).setup()
        t0 = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - t0
        out[name] = {
            "wall_s": wall,
            "saves": len(trainer.checkpoints.stalls),
            "steps": trainer.progress.step,
            "stall_s_total": sum(trainer.checkpoints.stalls),
            "overhead_percent": 100.0 * sum(trainer.checkpoints.stalls) / wall,
        }
    out["wall_ratio_every_steps_100_vs_epoch_end_only"] = (
        out["every_steps_100"]["wall_s"] / out["epoch_end_only"]["wall_s"]
    )
    return out


def _train_cli(run: Path, kill_at: str) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if k != "CLOUDML_KILL_AT"}
    env["CLOUDML_KILL_AT"] = kill_at
    cmd = [
        sys.executable,
        "-m",
        "cloudml_lib",
        "train",
        "--config",
        "configs/demo.yaml",
        "--run-dir",
        str(run),
        "--set",
        "train.epochs=1",
        "--set",
        "train.log_every_steps=1",
        "--set",
        "checkpoint.every_steps=4",
    ]
    for o in DEMO_DATA:
        cmd += ["--set", o]
    t0 = time.time()
    rc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True).returncode
    assert rc == -9, f"expected the planned SIGKILL at {kill_at}, got exit status {rc}"
    return rc, t0


def _check_resumed_at(run: Path, step: int) -> None:
    """A resume that silently started over would time a fresh start: check where it began."""
    start = json.loads((run / "run.json").read_text())["start_step"]
    assert start == step, f"{run}: the resume began at step {start}, not at the checkpoint of step {step}"


def _first_step_after(run: Path, t0: float) -> float:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "step" and r["time"] >= t0:
            return r["time"] - t0
    raise RuntimeError(f"no step after the start in {run}")


def resume_startup(repeats: int = 3) -> dict:
    """Start-up to the first step: fresh, and resumed early (step 4) or late (step 32 of 39) in an epoch."""
    times = {"fresh": [], "resume_early": [], "resume_late": []}
    for i in range(repeats):
        run = SCRATCH / f"startup-{i}"
        shutil.rmtree(run, ignore_errors=True)
        _, t0 = _train_cli(run, kill_at="step:5")  # checkpoint at step 4, killed at 5
        times["fresh"].append(_first_step_after(run, t0))
        _, t0 = _train_cli(run, kill_at="step:1")  # resume at step 4, stop after one step
        _check_resumed_at(run, 4)
        times["resume_early"].append(_first_step_after(run, t0))
        shutil.rmtree(run, ignore_errors=True)
        _train_cli(run, kill_at="step:34")  # checkpoint at step 32, killed at 34
        _, t0 = _train_cli(run, kill_at="step:1")
        _check_resumed_at(run, 32)
        times["resume_late"].append(_first_step_after(run, t0))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "seconds_to_first_step_median": med,
        "runs": times,
        "resume_early_over_fresh": med["resume_early"] / med["fresh"],
        "resume_late_over_fresh": med["resume_late"] / med["fresh"],
    }


def main() -> None:
    from cloudml_lib.data.synthetic import ensure_demo_flights

    ensure_demo_flights(demo_config().data)
    result = {
        "what": "checkpoint stall, run overhead and resume start-up (see the module docstring)",
        "machine": machine(),
        "setting": "local disk, CPU training",
        "stall_per_save": stall_per_save(),
        "run_overhead": run_overhead(),
        "targets": {
            "overhead_percent at every_steps=100": "<= 0.5",
            "resume start-up over fresh start": "<= 1.2, early or late in an epoch",
        },
    }
    result["resume_startup"] = resume_startup()
    out = REPO / "benchmarks" / "results" / "checkpoint.json"
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
