"""torch.compile against eager for each preset on this CPU: steps, whole epochs, cold and warm compiles.

    python benchmarks/compile_presets.py                                 # writes compile_presets.json
    python benchmarks/compile_presets.py --smoke --results OUT.json      # a tiny model: the code path only
    python benchmarks/compile_presets.py --presets A,B --steps-only --add   # add presets, no Trainer epochs

The presets, each with its own model settings (channels, gradient checkpointing) at a reduced frame and
batch on the CPU (RAW_FRAME, SWATH and PRESETS below; the results say which):
  A     configs/colab_optimized_full.yaml  64/128/256, checkpointing, compiled;
  B     configs/colab_full_stable.yaml     the same network, eager by design (its compiled row is the cost
                                           of not compiling);
  C     configs/colab_optimized.yaml       32/64/128, checkpointing;
  demo  configs/demo.yaml                  16/32/64, no checkpointing, its own batch.
For each preset, in processes of their own (torch.set_num_threads(2)):
  steps   forward, backward and AdamW on one fixed batch, the frame encoder compiled in place as CloudML
          does (cloudml_lib/core/network/compile.py), with an empty inductor cache: the first compiled step
          gives the cold compile; then BLOCKS blocks of PAIRS eager and compiled steps alternating on the same
          model (the compiled forward switched on and off), so both see the same machine load; each block's
          ratio of medians gives the spread;
  warm    a fresh process on the same inductor cache (in-memory caches gone, the disk cache kept): the
          first compiled step again, the warm compile;
  epochs  the real Trainer (setup, EPOCHS epochs with validation and checkpoints) on demo flights written at
          the same frame, eager and then compiled, so the compile's first steps and every fixed per-epoch cost
          are inside the ratio. The compiled run uses the inductor cache the steps left (on a 2-core machine
          shared with other work a cold compile takes minutes): the training step's graph compiles warm,
          the validation's and any other batch shape's cold; the cold compile is the steps' row.
Break-even: the compile seconds over the seconds a compiled step saves.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "compile_presets.json"
SCRATCH = REPO / "benchmarks" / ".scratch" / "compile_presets"
# name: (config, batch on this CPU: the presets' batches over 4, the demo's own)
PRESETS = {
    "A": ("colab_optimized_full.yaml", 5),
    "B": ("colab_full_stable.yaml", 4),
    "C": ("colab_optimized.yaml", 4),
    "demo": ("demo.yaml", 16),
}
RAW_FRAME, SWATH = (80, 96), [8, 72]  # the demo camera's: frames of 64 x 96 for every preset
FLIGHT_FRAMES, EPOCHS = 160, 3  # tiny epochs: about 40 training samples
BLOCKS, PAIRS = 3, 3
SMOKE = {"raw_frame": (24, 32), "swath": [4, 20], "flight_frames": 120, "epochs": 1, "blocks": 1, "pairs": 1}
THREADS = 2


def sizes(smoke: bool) -> dict:
    full = {"raw_frame": RAW_FRAME, "swath": SWATH, "flight_frames": FLIGHT_FRAMES, "epochs": EPOCHS}
    return SMOKE if smoke else {**full, "blocks": BLOCKS, "pairs": PAIRS}


def preset_config(name: str, scratch: Path, smoke: bool, compiled: bool = False):
    """The preset's config on this machine: its model and train settings, the scratch demo flights at the
    reduced frame, its batch reduced (PRESETS), no loader workers (2 shared cores)."""
    from cloudml_lib.base.config import load_config

    config, batch = PRESETS[name]
    s = sizes(smoke)
    overrides = [
        f"data.dir={scratch / 'flights'}",
        f"data.cache_dir={scratch / 'cache'}",
        "data.cache_copy_dir=",
        "data.demo=true",
        "data.test_flights=[05Mar25]",
        f"data.swath_slice=[{s['swath'][0]},{s['swath'][1]}]",
        "data.num_workers=0",
        f"train.batch_size={batch}",
        f"train.epochs={s['epochs']}",
        f"train.torch_compile={str(compiled).lower()}",
    ]
    if smoke:
        overrides.append("model.channels=[4,8,8]")
    return load_config(REPO / "configs" / config, overrides)


def measure_steps(name: str, scratch: Path, smoke: bool, warm: bool) -> dict:
    """Eager and compiled steps side by side on one fixed batch (this process's inductor cache: the
    caller's). `warm`: only the first compiled step and two more (the compile seconds)."""
    import torch

    from cloudml_lib.core.network.compile import apply_compile
    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.data.dataset import n_scalar_inputs
    from cloudml_lib.train import batch_loss

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    cfg = preset_config(name, scratch, smoke)
    s, batch = sizes(smoke), PRESETS[name][1]
    model = build_model(cfg)
    model.set_grad_checkpointing(cfg.model.gradient_checkpointing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    frame = (s["swath"][1] - s["swath"][0], s["raw_frame"][1])
    frames = torch.randn(batch, cfg.data.temporal_frames, *frame, generator=gen)  # (B, T, H, W)
    scalars = torch.randn(batch, n_scalar_inputs(cfg.data.radiometry), generator=gen)
    target = torch.randn(batch, generator=gen)

    def step() -> float:
        t0 = time.perf_counter()
        batch_loss(model(frames, scalars), {"target": target}, cfg.train).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step()  # eager warm-up
    watch = apply_compile(model, True, "default", torch.device("cpu"))
    compiled_forward = model.encoder.forward

    def use(compiled: bool) -> None:
        if compiled:
            model.encoder.forward = compiled_forward
        else:
            vars(model.encoder).pop("forward", None)

    first = step()
    after = [step(), step()] if warm else [step()]
    blocks = [] if warm else [alternate(step, use, s["pairs"]) for _ in range(s["blocks"])]
    report = watch.update()
    compiled_s = [c for b in blocks for c in b["compiled_s"]] or after
    return {
        "first_compiled_step_s": first,
        "compile_s": max(0.0, first - statistics.median(compiled_s)),
        "dynamo_compile_s": report.compile_s,
        "graphs": report.graphs,
        "graph_breaks": report.graph_breaks,
        "blocks": blocks,
        "frame": list(frame),
        "batch": batch,
        "channels": list(cfg.channels),
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
    }


def alternate(step, use, pairs: int) -> dict:
    """`pairs` eager and compiled steps, alternating (which goes first alternates too)."""
    eager, compiled = [], []
    for i in range(pairs):
        for c in (False, True) if i % 2 == 0 else (True, False):
            use(c)
            (compiled if c else eager).append(step())
    use(True)
    return {"eager_s": eager, "compiled_s": compiled}


def run_epochs(name: str, scratch: Path, smoke: bool, compiled: bool, run_dir: Path) -> dict:
    """The real Trainer: setup, then each epoch (train, validate, checkpoint) timed."""
    import torch

    from cloudml_lib.train import Trainer

    torch.set_num_threads(THREADS)
    cfg = preset_config(name, scratch, smoke, compiled)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, run_dir, resume="never").setup()
    setup_s, epoch_s = time.perf_counter() - t0, []
    try:
        for _ in range(cfg.train.epochs):
            t = time.perf_counter()
            trainer.run_epoch()
            epoch_s.append(time.perf_counter() - t)
        report = trainer.compile.update()
        return {
            "setup_s": setup_s,
            "epoch_s": epoch_s,
            "steps_per_epoch": trainer.steps_per_epoch,
            "compiled": report.active,
            "fallback": report.fallback,
            "dynamo_compile_s": report.compile_s,
            "recompiles": report.recompiles,
        }
    finally:
        trainer.close()


def child(args: list[str], scratch: Path, smoke: bool, cache: Path) -> dict:
    """One measurement in a fresh process whose inductor cache is `cache`."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), CLOUDML_PROGRESS="0", TQDM_DISABLE="1")
    cmd = [sys.executable, __file__, "--scratch", str(scratch), "--child", *args]
    r = subprocess.run(
        cmd + (["--smoke"] if smoke else []), cwd=REPO, env=env, capture_output=True, text=True
    )
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepare(scratch: Path, smoke: bool, presets: list[str]) -> None:
    """The demo flights at the reduced frame, and each preset's cache, built once outside the timings."""
    from cloudml_lib.data.dataset import prepare_data
    from cloudml_lib.data.flights import resolve_config
    from cloudml_lib.data.synthetic import make_demo_flights

    s = sizes(smoke)
    if not (scratch / "flights").is_dir():
        make_demo_flights(
            scratch / "flights", frames_per_flight=s["flight_frames"], frame_shape=tuple(s["raw_frame"])
        )
    for name in presets:
        cfg, skipped = resolve_config(preset_config(name, scratch, smoke))
        prepare_data(cfg, skipped)


def measure_preset(name: str, scratch: Path, smoke: bool, epochs: bool = True) -> dict:
    """Steps (cold), the warm compile, then the epochs eager and compiled: the raw numbers of one preset."""
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        out["steps"] = child(["steps", name], scratch, smoke, Path(cache))
        out["warm"] = child(["warm", name], scratch, smoke, Path(cache))
        for compiled in (False, True) if epochs else ():
            run_dir = scratch / "runs" / f"{name}-{'compiled' if compiled else 'eager'}"
            shutil.rmtree(run_dir, ignore_errors=True)
            t0 = time.perf_counter()
            r = child(["epochs", name, str(int(compiled)), str(run_dir)], scratch, smoke, Path(cache))
            key = "epochs_compiled" if compiled else "epochs_eager"
            out[key] = {**r, "process_s": time.perf_counter() - t0}
    return out


def summary(raw: dict) -> dict:
    """The ratios of one preset: steps/s eager and compiled, each block's ratio (median and range), the
    epochs' ratio (whole and after the first epoch), compile seconds cold and warm, break-even steps."""
    st, batch = raw["steps"], raw["steps"]["batch"]
    eager = [e for b in st["blocks"] for e in b["eager_s"]]
    comp = [c for b in st["blocks"] for c in b["compiled_s"]]
    ratios = [statistics.median(b["eager_s"]) / statistics.median(b["compiled_s"]) for b in st["blocks"]]
    pairs = [e / c for b in st["blocks"] for e, c in zip(b["eager_s"], b["compiled_s"])]
    med_e, med_c = statistics.median(eager), statistics.median(comp)
    saved = med_e - med_c
    return {
        "eager_steps_per_s": 1 / med_e,
        "compiled_steps_per_s": 1 / med_c,
        "eager_samples_per_s": batch / med_e,
        "compiled_samples_per_s": batch / med_c,
        "step_ratio": statistics.median(ratios),
        "step_ratio_min": min(ratios),
        "step_ratio_max": max(ratios),
        "pair_ratio_min": min(pairs),
        "pair_ratio_max": max(pairs),
        **epoch_ratios(raw),
        "compile_cold_s": st["compile_s"],
        "compile_warm_s": raw["warm"]["compile_s"],
        "break_even_steps_cold": round(st["compile_s"] / saved) if saved > 0 else None,
        "break_even_steps_warm": round(raw["warm"]["compile_s"] / saved) if saved > 0 else None,
    }


def epoch_ratios(raw: dict) -> dict:
    """Eager over compiled time of the Trainer's epochs: all of them, those after the first, the processes."""
    if "epochs_eager" not in raw:
        return {"epochs_ratio": None, "epochs_ratio_after_first": None, "process_ratio": None}
    ee, ec = raw["epochs_eager"]["epoch_s"], raw["epochs_compiled"]["epoch_s"]
    return {
        "epochs_ratio": sum(ee) / sum(ec),
        "epochs_ratio_after_first": sum(ee[1:]) / sum(ec[1:]) if len(ee) > 1 else None,
        "process_ratio": raw["epochs_eager"]["process_s"] / raw["epochs_compiled"]["process_s"],
    }


def decisions(s: dict) -> dict:
    """What the numbers support, each with its rule."""
    out = {}
    if "C" in s:
        c = s["C"]
        out["C_compiled"] = {
            "yes": c["step_ratio"] >= 1.0,
            "rule": "compiled like A unless compiled steps are slower than eager (median block ratio < 1)",
        }
    if "demo" in s:
        d, run_steps = s["demo"], demo_run_steps()
        be = d["break_even_steps_cold"]
        out["demo_compiled_on_cpu"] = {
            "yes": d["step_ratio_min"] > 1.0 and be is not None and run_steps is not None and be < run_steps,
            "demo_run_steps": run_steps,
            "rule": "every block's ratio above 1 and the cold compile paid back within one demo run's steps",
        }
    if "A" in s and "B" in s:
        a, b = s["A"], s["B"]
        out["B_cost"] = {
            "b_eager_over_a_compiled_samples": b["eager_samples_per_s"] / a["compiled_samples_per_s"],
            "b_compiled_over_b_eager_steps": b["step_ratio"],
            "rule": "B's eager throughput against A's compiled one, and what compiling B itself would gain",
        }
    return out


def demo_run_steps() -> int | None:
    """A demo run's optimizer steps: configs/demo.yaml's epochs times the demo's steps per epoch (measured in
    benchmarks/results/trainers.json at the demo's own batch)."""
    from cloudml_lib.base.config import load_config

    path = REPO / "benchmarks" / "results" / "trainers.json"
    if not path.exists():
        return None
    t = json.loads(path.read_text())
    return load_config(REPO / "configs" / "demo.yaml").train.epochs * t["optimizer_steps"] // t["epochs"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="a tiny model on tiny flights, the demo preset only")
    p.add_argument("--results", type=Path, help="where to write the results (default: the committed file)")
    p.add_argument("--presets", help=f"comma-separated, from {', '.join(PRESETS)}")
    p.add_argument("--steps-only", action="store_true", help="no Trainer epochs (for a slow machine)")
    p.add_argument("--add", action="store_true", help="add the presets to the results file already there")
    p.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    scratch = args.scratch or (SCRATCH / ("smoke" if args.smoke else "run"))
    if args.child:
        kind, name, *rest = args.child
        r = (
            run_epochs(name, scratch, args.smoke, rest[0] == "1", Path(rest[1]))
            if kind == "epochs"
            else measure_steps(name, scratch, args.smoke, warm=kind == "warm")
        )
        print(json.dumps(r))
        return
    if args.smoke and not args.results:
        p.error("--smoke needs --results: a smoke run never writes the committed results")
    presets = args.presets.split(",") if args.presets else (["demo"] if args.smoke else list(PRESETS))
    results = args.results or RESULTS
    old = json.loads(results.read_text()) if args.add and results.exists() else None
    write(presets, scratch, args.smoke, results, not args.steps_only, old)


def write(
    presets: list[str], scratch: Path, smoke: bool, results: Path, epochs: bool, old: dict | None
) -> None:
    t0 = time.perf_counter()
    if smoke:
        shutil.rmtree(scratch, ignore_errors=True)
    prepare(scratch, smoke, presets)
    s = sizes(smoke)
    out = {
        "machine": {**machine(), "torch_threads": THREADS},
        "frame": [s["swath"][1] - s["swath"][0], s["raw_frame"][1]],
        "batch": {n: PRESETS[n][1] for n in presets},
        "epochs": s["epochs"],
        "epochs_inductor_cache": "warm from the steps (the validation's graphs compile cold)",
        "blocks": s.get("blocks"),
        "pairs_per_block": s.get("pairs"),
        "smoke": smoke,
        "raw": {},
        "summary": {},
    }
    if old:  # added presets: their batches and whether they ran epochs are recorded beside the others'
        out = {**old, "batch": {**old["batch"], **out["batch"]}}
    for name in presets:
        out["raw"][name] = measure_preset(name, scratch, smoke, epochs)
        out["summary"][name] = summary(out["raw"][name])
        print(name, json.dumps(out["summary"][name]), flush=True)
        results.write_text(json.dumps(out, indent=1))  # after each preset: a late failure keeps the rest
    out["decisions"] = decisions(out["summary"])
    out["run_minutes"] = (old or {}).get("run_minutes", 0) + (time.perf_counter() - t0) / 60
    results.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["decisions"], indent=1))


if __name__ == "__main__":
    main()
