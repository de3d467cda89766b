"""The CloudML trainer against what users would pick instead, on this machine's CPU.

Same model, same cached demo data, same batches (CloudML's EpochBatchSampler), same optimizer,
schedule and number of optimizer steps, no validation in any of them:
  bare       a minimal hand-written loop;
  cloudml    the CloudML Trainer with its defaults (its own train_epoch: recovery, checkpoints every
             100 steps and at epoch ends, metrics records, progress bar);
  lightning  a PyTorch Lightning Trainer with an equivalent LightningModule and
             ModelCheckpoint(every_n_train_steps=100). Lightning calls set_epoch only on a plain
             sampler: with a custom batch sampler a callback must do it, or every epoch repeats
             epoch 1's order.
Each run is its own process; the three alternate, REPEATS times. Reported: the training part
(measured inside the process) and the whole process (measured outside), median and spread.
Writes benchmarks/results/trainers.json. Needs `pip install -r benchmarks/requirements.txt`.
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SCRATCH = REPO / "benchmarks" / ".scratch" / "trainers"
RESULTS = REPO / "benchmarks" / "results" / "trainers.json"
METHODS = ("bare", "cloudml", "lightning")
EPOCHS, REPEATS = 3, 3


def config():
    from cloudml_lib.config import load_config
    return load_config(REPO / "configs" / "demo.yaml", [f"data.dir={SCRATCH / 'flights'}",
                                                         f"data.cache_dir={SCRATCH / 'cache'}",
                                                         f"train.epochs={EPOCHS}"])


def data(cfg):
    from cloudml_lib.data.dataset import prepare_data
    from cloudml_lib.data.flights import prepare_flights
    prepare_flights(cfg.data)
    return prepare_data(cfg)


def schedule(optimizer, cfg, steps_per_epoch):
    import functools

    import torch

    from cloudml_lib.train import lr_factor
    t = cfg.train
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(
        lr_factor, warmup_steps=t.warmup_steps, total_steps=steps_per_epoch * t.epochs, min_ratio=t.min_lr_ratio))


def bare_step(model, optimizer, scheduler, batch: dict, t) -> None:
    """One optimizer step of the hand-written loop (the reference for both measurements)."""
    import torch

    from cloudml_lib.train import weighted_huber
    loss = weighted_huber(model(batch["frames"], batch["scalars"]), batch["target"], batch["weight"],
                          t.huber_delta, t.hard_example_weight)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def run_bare(cfg) -> float:
    import torch
    from torch.utils.data import DataLoader

    from cloudml_lib.data.dataset import EpochBatchSampler
    from cloudml_lib.model import build_model
    from cloudml_lib.train import seed_everything
    t = cfg.train
    seed_everything(t.seed)
    train_set, _ = data(cfg)
    model = build_model(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    sampler = EpochBatchSampler(len(train_set), t.batch_size, t.seed)
    scheduler = schedule(optimizer, cfg, sampler.batches_per_epoch())
    loader = DataLoader(train_set, batch_sampler=sampler, num_workers=0)
    t0 = time.perf_counter()
    for epoch in range(t.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            bare_step(model, optimizer, scheduler, batch, t)
    return time.perf_counter() - t0


def run_cloudml(cfg, run_dir: Path) -> float:
    from cloudml_lib.train import Trainer
    trainer = Trainer(cfg, run_dir).setup()
    t0 = time.perf_counter()
    try:
        for epoch in range(cfg.train.epochs):              # fit() without the validation
            trainer.train_epoch(epoch)
            trainer.state["epoch"], trainer.state["batch"] = epoch + 1, 0
            trainer.save_checkpoint("epoch_end")
        trainer.writer.wait()
        return time.perf_counter() - t0
    finally:
        trainer.close()


def run_lightning(cfg, run_dir: Path) -> float:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from cloudml_lib.data.dataset import EpochBatchSampler
    from cloudml_lib.model import build_model
    from cloudml_lib.train import seed_everything, weighted_huber
    t = cfg.train
    seed_everything(t.seed)
    train_set, _ = data(cfg)
    sampler = EpochBatchSampler(len(train_set), t.batch_size, t.seed)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model(cfg)

        def training_step(self, batch, _):
            return weighted_huber(self.net(batch["frames"], batch["scalars"]), batch["target"], batch["weight"],
                                  t.huber_delta, t.hard_example_weight)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": schedule(optimizer, cfg, sampler.batches_per_epoch()), "interval": "step"}}

    class SetEpoch(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            sampler.set_epoch(trainer.current_epoch)

    class Clock(L.Callback):
        def on_train_start(self, trainer, module):
            self.t0 = time.perf_counter()

        def on_train_end(self, trainer, module):
            self.seconds = time.perf_counter() - self.t0

    clock = Clock()
    trainer = L.Trainer(max_epochs=t.epochs, accelerator="cpu", devices=1, logger=False, enable_progress_bar=True,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        gradient_clip_val=t.grad_clip_norm, use_distributed_sampler=False, default_root_dir=run_dir,
                        callbacks=[SetEpoch(), clock, L.pytorch.callbacks.ModelCheckpoint(
                            dirpath=run_dir / "checkpoints", every_n_train_steps=100, save_last=True)])
    trainer.fit(Module(), DataLoader(train_set, batch_sampler=sampler, num_workers=0))
    return clock.seconds


def per_step_overhead(run_dir: Path, pairs: int = 5) -> dict:
    """The trainer's own per-step cost, measured directly: in one process, with the epoch's batches
    preloaded (data loading is out of both), alternate an epoch of the bare step with an epoch of
    Trainer.train_epoch over the same batches and the same model. Overhead = difference of the
    medians / steps. Includes everything train_epoch adds: recovery snapshots, accumulators, one
    sync per step, metrics records, the progress bar, the checkpoint cadence."""
    from cloudml_lib.train import Trainer
    cfg = config()
    t = cfg.train
    trainer = Trainer(cfg, run_dir).setup()
    try:
        trainer.sampler.set_epoch(0)
        batches = list(trainer.loader)
        trainer.loader = batches
        model, opt, sched = trainer.model, trainer.optimizer, trainer.scheduler

        def bare_epoch():
            for batch in batches:
                bare_step(model, opt, sched, batch, t)

        def cloudml_epoch():
            trainer.state["batch"] = 0
            trainer.train_epoch(0)

        times = {"bare": [], "cloudml": []}
        for _ in range(pairs):
            for name, fn in (("bare", bare_epoch), ("cloudml", cloudml_epoch)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        steps = len(batches)
        med = {k: statistics.median(v) for k, v in times.items()}
        return {"steps_per_epoch": steps, "pairs": pairs, "epoch_s": times,
                "bare_step_ms": 1000 * med["bare"] / steps, "cloudml_step_ms": 1000 * med["cloudml"] / steps,
                "overhead_ms_per_step": 1000 * (med["cloudml"] - med["bare"]) / steps,
                "overhead_ratio": med["cloudml"] / med["bare"]}
    finally:
        trainer.close()


def child(method: str, run_dir: Path) -> None:
    import torch
    torch.set_num_threads(torch.get_num_threads())
    cfg = config()
    if method == "overhead":
        print(json.dumps(per_step_overhead(run_dir)))
        return
    seconds = {"bare": lambda: run_bare(cfg), "cloudml": lambda: run_cloudml(cfg, run_dir),
               "lightning": lambda: run_lightning(cfg, run_dir)}[method]()
    print(json.dumps({"train_s": seconds}))


def machine() -> dict:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    import lightning
    return {"cpu": cpu, "cores": __import__("os").cpu_count(), "torch": torch.__version__,
            "lightning": lightning.__version__, "python": platform.python_version()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=METHODS + ("overhead",))
    p.add_argument("--run-dir")
    args = p.parse_args()
    if args.child:
        child(args.child, Path(args.run_dir))
        return
    from cloudml_lib.data.synthetic import ensure_demo_flights
    cfg = config()
    ensure_demo_flights(cfg.data)
    data(cfg)                                            # build the cache once, outside the timings
    runs = {m: [] for m in METHODS}
    for repeat in range(REPEATS):
        for method in METHODS:                           # interleaved: drift hits all three alike
            run_dir = SCRATCH / "runs" / f"{method}-{repeat}"
            shutil.rmtree(run_dir, ignore_errors=True)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, __file__, "--child", method, "--run-dir", str(run_dir)],
                               capture_output=True, text=True, cwd=REPO)
            whole = time.perf_counter() - t0
            if r.returncode != 0:
                raise SystemExit(f"{method} failed:\n{r.stderr[-3000:]}")
            train_s = json.loads(r.stdout.strip().splitlines()[-1])["train_s"]
            runs[method].append({"train_s": train_s, "process_s": whole})
            print(f"{method:9s} repeat {repeat}: training {train_s:.2f} s, whole process {whole:.2f} s", flush=True)
    summary = {}
    for m, rows in runs.items():
        tr, pr = [r["train_s"] for r in rows], [r["process_s"] for r in rows]
        summary[m] = {"train_s_median": statistics.median(tr), "train_s_spread": max(tr) - min(tr),
                      "process_s_median": statistics.median(pr), "process_s_spread": max(pr) - min(pr)}
    for m in ("cloudml", "lightning"):
        summary[m]["train_vs_bare"] = summary[m]["train_s_median"] / summary["bare"]["train_s_median"]
        summary[m]["process_vs_bare"] = summary[m]["process_s_median"] / summary["bare"]["process_s_median"]
    run_dir = SCRATCH / "runs" / "overhead"
    shutil.rmtree(run_dir, ignore_errors=True)
    r = subprocess.run([sys.executable, __file__, "--child", "overhead", "--run-dir", str(run_dir)],
                       capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"overhead failed:\n{r.stderr[-3000:]}")
    overhead = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"per-step overhead of the CloudML trainer: {overhead['overhead_ms_per_step']:.2f} ms "
          f"({overhead['overhead_ratio']:.3f}x the bare step)")
    steps = EPOCHS * 39
    result = {"machine": machine(), "epochs": EPOCHS, "optimizer_steps": steps, "repeats": REPEATS,
              "summary": summary, "per_step_overhead": overhead, "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
