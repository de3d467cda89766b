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

Resume (CloudML and Lightning, both saving every RESUME_EVERY steps): a run SIGKILLed at step
KILL_STEP (mid-epoch 2) and started again; reported: launch of the resumed process to its first
optimizer step (beside the same for a fresh start), and its final weights against the same
method's uninterrupted run (bit-identical or the largest difference).

Writes benchmarks/results/trainers.json. Needs `pip install -r benchmarks/requirements.txt`.

`--before REV` measures instead the per-step overhead above for the code of REV (a git revision, checked
out in a scratch worktree) and for this checkout's, in alternating processes (BEFORE_AFTER_ROUNDS each, on
the same demo flights and cache): each side's ratios of adjacent CloudML and bare epochs, pooled, with
their median and quartiles, and whether the two medians differ by more than the spread. Writes
benchmarks/results/trainer_before_after.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import machine  # noqa: E402

SCRATCH = REPO / "benchmarks" / ".scratch" / "trainers"
RESULTS = REPO / "benchmarks" / "results" / "trainers.json"
METHODS = ("bare", "cloudml", "lightning")
EPOCHS, REPEATS = 3, 5
RESUME_EVERY, KILL_STEP = 20, 50  # saves at steps 20, 40; killed at 50 (epoch 2, batch 11 of 39)
OVERHEAD_PAIRS = 9
BEFORE_AFTER_ROUNDS, BEFORE_AFTER_PAIRS = 3, 5
BEFORE_AFTER = REPO / "benchmarks" / "results" / "trainer_before_after.json"
CODE_ENV = "CLOUDML_BENCH_CODE"  # a child imports cloudml_lib from this folder (the `--before` revision's)


class FirstStep:
    """time.time() of this process's first optimizer step."""

    at: float | None = None

    @classmethod
    def mark(cls) -> None:
        if cls.at is None:
            cls.at = time.time()


def config():
    from cloudml_lib.base.config import load_config

    return load_config(
        REPO / "configs" / "demo.yaml",
        [f"data.dir={SCRATCH / 'flights'}", f"data.cache_dir={SCRATCH / 'cache'}", f"train.epochs={EPOCHS}"],
    )


def data(cfg):
    from cloudml_lib.data.dataset import prepare_data
    from cloudml_lib.data.flights import resolve_config

    cfg, skipped = resolve_config(cfg)
    return prepare_data(cfg, skipped)


def schedule(optimizer, cfg, steps_per_epoch):
    import functools

    import torch

    from cloudml_lib.train import lr_factor

    t = cfg.train
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        functools.partial(
            lr_factor,
            warmup_steps=t.warmup_steps,
            total_steps=steps_per_epoch * t.epochs,
            min_ratio=t.min_lr_ratio,
        ),
    )


def bare_step(model, optimizer, scheduler, batch: dict, t) -> None:
    """One optimizer step of the hand-written loop (the reference for both measurements)."""
    import torch

    from cloudml_lib.train import batch_loss

    loss = batch_loss(model(batch["frames"], batch["scalars"]), batch, t)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
    optimizer.step()
    FirstStep.mark()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def run_bare(cfg) -> float:
    import torch
    from torch.utils.data import DataLoader

    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.data.dataset import EpochBatchSampler
    from cloudml_lib.train import seed_everything

    t = cfg.train
    seed_everything(t.seed)
    train_set = data(cfg).train_set
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

    trainer = Trainer(cfg, run_dir).setup()  # resumes from run_dir's newest checkpoint
    step = trainer.optimizer_step

    def marked_step():
        step()
        FirstStep.mark()

    trainer.optimizer_step = marked_step
    t0 = time.perf_counter()
    try:
        for epoch in range(trainer.progress.epoch, cfg.train.epochs):  # fit() without the validation
            trainer.train_epoch(epoch)
            trainer.progress.epoch, trainer.progress.batch = epoch + 1, 0
            trainer.checkpoints.save("epoch_end")
        trainer.checkpoints.wait()
        seconds = time.perf_counter() - t0
        save_weights(trainer.model, run_dir)
        return seconds
    finally:
        trainer.close()


def save_weights(model, run_dir: Path) -> None:
    import torch

    torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, run_dir / "final.pt")


def run_lightning(cfg, run_dir: Path, every_steps: int = 100, kill_step: int = 0) -> float:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from cloudml_lib.core.network.model import build_model
    from cloudml_lib.data.dataset import EpochBatchSampler
    from cloudml_lib.train import batch_loss, seed_everything

    t = cfg.train
    seed_everything(t.seed)
    train_set = data(cfg).train_set
    sampler = EpochBatchSampler(len(train_set), t.batch_size, t.seed)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = build_model(cfg)

        def training_step(self, batch, _):
            return batch_loss(self.net(batch["frames"], batch["scalars"]), batch, t)

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {
                    "scheduler": schedule(optimizer, cfg, sampler.batches_per_epoch()),
                    "interval": "step",
                },
            }

    class SetEpoch(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            sampler.set_epoch(trainer.current_epoch)

    class Clock(L.Callback):
        def on_train_start(self, trainer, module):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            FirstStep.mark()
            if kill_step and trainer.global_step == kill_step:
                os.kill(os.getpid(), signal.SIGKILL)  # as a disconnect would

        def on_train_end(self, trainer, module):
            self.seconds = time.perf_counter() - self.t0

    clock = Clock()
    last = run_dir / "checkpoints" / "last.ckpt"
    trainer = L.Trainer(
        max_epochs=t.epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=True,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        gradient_clip_val=t.grad_clip_norm,
        use_distributed_sampler=False,
        default_root_dir=run_dir,
        callbacks=[
            SetEpoch(),
            clock,
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=run_dir / "checkpoints", every_n_train_steps=every_steps, save_last=True
            ),
        ],
    )
    module = Module()
    trainer.fit(
        module,
        DataLoader(train_set, batch_sampler=sampler, num_workers=0),
        ckpt_path=last if last.exists() else None,
    )
    save_weights(module.net, run_dir)
    return clock.seconds


def per_step_overhead(run_dir: Path, pairs: int = OVERHEAD_PAIRS) -> dict:
    """The trainer's own per-step cost, measured directly: in one process, with the epoch's batches
    preloaded (data loading is out of both), alternate an epoch of the bare step with an epoch of
    Trainer.train_epoch over the same batches and the same model. Overhead = difference of the
    medians / steps; beside it, the ratio of each adjacent pair (its quartiles say whether the
    difference stands out of the noise). Includes everything train_epoch adds: recovery snapshots,
    accumulators, one sync per step, metrics records, the progress bar, the checkpoint cadence."""
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
            trainer.progress.batch = 0
            trainer.train_epoch(0)

        times = {"bare": [], "cloudml": []}
        for _ in range(pairs):
            for name, fn in (("bare", bare_epoch), ("cloudml", cloudml_epoch)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        steps = len(batches)
        med = {k: statistics.median(v) for k, v in times.items()}
        ratios = sorted(c / b for b, c in zip(times["bare"], times["cloudml"]))
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        return {
            "steps_per_epoch": steps,
            "pairs": pairs,
            "epoch_s": times,
            "pair_ratio_median": statistics.median(ratios),
            "pair_ratio_q1": q1,
            "pair_ratio_q3": q3,
            "bare_step_ms": 1000 * med["bare"] / steps,
            "cloudml_step_ms": 1000 * med["cloudml"] / steps,
            "overhead_ms_per_step": 1000 * (med["cloudml"] - med["bare"]) / steps,
            "overhead_ratio": med["cloudml"] / med["bare"],
        }
    finally:
        trainer.close()


def child(method: str, run_dir: Path, every_steps: int, kill_step: int, pairs: int = OVERHEAD_PAIRS) -> None:
    if os.environ.get(CODE_ENV):  # before anything imports cloudml_lib: the other revision's package
        sys.path.insert(0, os.environ[CODE_ENV])
    cfg = config()
    if method == "overhead":
        print(json.dumps(per_step_overhead(run_dir, pairs)))
        return
    if kill_step:
        os.environ["CLOUDML_KILL_AT"] = f"step:{kill_step}"  # the CloudML trainer's own fault point
    cfg.checkpoint.every_steps = every_steps
    seconds = {
        "bare": lambda: run_bare(cfg),
        "cloudml": lambda: run_cloudml(cfg, run_dir),
        "lightning": lambda: run_lightning(cfg, run_dir, every_steps, kill_step),
    }[method]()
    print(json.dumps({"train_s": seconds, "first_step_at": FirstStep.at}))


def launch(method: str, run_dir: Path, every_steps: int = 100, kill_step: int = 0) -> dict:
    """One child process: its JSON line, the whole process's seconds, and launch to first step."""
    t0, launched = time.perf_counter(), time.time()
    r = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            method,
            "--run-dir",
            str(run_dir),
            "--every-steps",
            str(every_steps),
            "--kill-step",
            str(kill_step),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    whole = time.perf_counter() - t0
    if kill_step:
        if r.returncode != -signal.SIGKILL:
            raise SystemExit(f"{method} was to be killed at step {kill_step}:\n{r.stderr[-3000:]}")
        return {"process_s": whole}
    if r.returncode != 0:
        raise SystemExit(f"{method} failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"train_s": out["train_s"], "process_s": whole, "to_first_step_s": out["first_step_at"] - launched}


def overhead_child(run_dir: Path, code: Path | None, pairs: int) -> dict:
    """One process measuring the per-step overhead, with cloudml_lib from `code` (None: this checkout)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    env = dict(os.environ, **({CODE_ENV: str(code)} if code else {}))
    cmd = [sys.executable, __file__, "--child", "overhead", "--run-dir", str(run_dir), "--pairs", str(pairs)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env)
    if r.returncode != 0:
        raise SystemExit(f"overhead ({code or 'this checkout'}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def pooled(results: list[dict]) -> dict:
    """Every pair's ratio (CloudML epoch / bare epoch) of a side's processes, with median and quartiles."""
    ratios = sorted(
        c / b for r in results for b, c in zip(r["epoch_s"]["bare"], r["epoch_s"]["cloudml"], strict=True)
    )
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    return {"pairs": len(ratios), "ratio_median": median, "ratio_q1": q1, "ratio_q3": q3, "ratios": ratios}


def before_and_after(rev: str) -> None:
    """The per-step overhead of `rev`'s trainer and of this checkout's, in alternating processes."""
    from cloudml_lib.data.synthetic import ensure_demo_flights

    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True, cwd=REPO
    )
    if commit.returncode != 0:
        raise SystemExit(f"--before {rev}: not a revision of this repository ({commit.stderr.strip()})")
    worktree = SCRATCH / "before"
    subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], capture_output=True, cwd=REPO)
    shutil.rmtree(worktree, ignore_errors=True)
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), rev], check=True, cwd=REPO)
    try:
        cfg = config()
        ensure_demo_flights(cfg.data)
        data(cfg)  # the cache built once, outside the timings
        sides = {"before": [], "after": []}
        for n in range(BEFORE_AFTER_ROUNDS):  # alternating: the machine's drift hits both alike
            for side, code in (("before", worktree), ("after", None)):
                r = overhead_child(SCRATCH / "runs" / f"overhead-{side}-{n}", code, BEFORE_AFTER_PAIRS)
                sides[side].append(r)
                print(
                    f"{side} round {n}: pair ratios {r['pair_ratio_q1']:.3f}..{r['pair_ratio_q3']:.3f}",
                    flush=True,
                )
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], capture_output=True, cwd=REPO)
    before, after = pooled(sides["before"]), pooled(sides["after"])
    spread = max(before["ratio_q3"] - before["ratio_q1"], after["ratio_q3"] - after["ratio_q1"])
    result = {
        "machine": machine(),
        "before": {"revision": rev, "commit": commit.stdout.strip(), **before},
        "after": {
            "commit": subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO
            ).stdout.strip(),
            **after,
        },
        "median_difference": after["ratio_median"] - before["ratio_median"],
        "spread": spread,
        "worse_than_spread": after["ratio_median"] - before["ratio_median"] > spread,
        "rounds": BEFORE_AFTER_ROUNDS,
        "pairs_per_process": BEFORE_AFTER_PAIRS,
        "processes": sides,
    }
    BEFORE_AFTER.write_text(json.dumps(result, indent=1))
    print(
        f"CloudML epoch / bare epoch: before {before['ratio_median']:.3f} ({before['ratio_q1']:.3f}.."
        f"{before['ratio_q3']:.3f}), after {after['ratio_median']:.3f} ({after['ratio_q1']:.3f}.."
        f"{after['ratio_q3']:.3f}); the difference {result['median_difference']:+.3f} against a spread of "
        f"{spread:.3f}: {'worse' if result['worse_than_spread'] else 'no worse'} than the spread"
    )


def resume_runs() -> dict:
    """Per method: uninterrupted, killed + resumed; launch-to-first-step of a fresh and a resumed
    start; the final weights of the resumed run against the uninterrupted one."""
    import torch

    out = {}
    for method in ("cloudml", "lightning"):
        base = SCRATCH / "runs" / f"resume-{method}"
        shutil.rmtree(base, ignore_errors=True)
        straight, cut = base / "straight", base / "cut"
        fresh = launch(method, straight, RESUME_EVERY)
        launch(method, cut, RESUME_EVERY, KILL_STEP)
        resumed = launch(method, cut, RESUME_EVERY)
        a, b = (torch.load(d / "final.pt", weights_only=True) for d in (straight, cut))
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        out[method] = {
            "fresh_to_first_step_s": fresh["to_first_step_s"],
            "resumed_to_first_step_s": resumed["to_first_step_s"],
            "bit_identical": all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_diff": diff,
        }
        print(
            f"{method:9s} resume: first step {resumed['to_first_step_s']:.2f} s after launch (fresh start "
            f"{fresh['to_first_step_s']:.2f} s); final weights max |diff| {diff:.3g}",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=METHODS + ("overhead",))
    p.add_argument("--run-dir")
    p.add_argument("--every-steps", type=int, default=100)
    p.add_argument("--kill-step", type=int, default=0)
    p.add_argument("--pairs", type=int, default=OVERHEAD_PAIRS)
    p.add_argument("--before", metavar="REV", help="the per-step overhead of REV's code beside this one's")
    args = p.parse_args()
    if args.child:
        child(args.child, Path(args.run_dir), args.every_steps, args.kill_step, args.pairs)
        return
    if args.before:
        before_and_after(args.before)
        return
    from cloudml_lib.data.synthetic import ensure_demo_flights

    cfg = config()
    ensure_demo_flights(cfg.data)
    data(cfg)  # build the cache once, outside the timings
    runs = {m: [] for m in METHODS}
    for repeat in range(REPEATS):
        for method in METHODS:  # interleaved: drift hits all three alike
            run_dir = SCRATCH / "runs" / f"{method}-{repeat}"
            shutil.rmtree(run_dir, ignore_errors=True)
            row = launch(method, run_dir)
            runs[method].append(row)
            print(
                f"{method:9s} repeat {repeat}: training {row['train_s']:.2f} s, whole process "
                f"{row['process_s']:.2f} s",
                flush=True,
            )
    summary = {}
    for m, rows in runs.items():
        tr, pr = [r["train_s"] for r in rows], [r["process_s"] for r in rows]
        summary[m] = {
            "train_s_median": statistics.median(tr),
            "train_s_spread": max(tr) - min(tr),
            "train_s_best": min(tr),
            "process_s_median": statistics.median(pr),
            "process_s_spread": max(pr) - min(pr),
        }
    for m in ("cloudml", "lightning"):
        summary[m]["train_vs_bare"] = summary[m]["train_s_median"] / summary["bare"]["train_s_median"]
        summary[m]["train_best_vs_bare"] = summary[m]["train_s_best"] / summary["bare"]["train_s_best"]
        summary[m]["process_vs_bare"] = summary[m]["process_s_median"] / summary["bare"]["process_s_median"]
    run_dir = SCRATCH / "runs" / "overhead"
    shutil.rmtree(run_dir, ignore_errors=True)
    r = subprocess.run(
        [sys.executable, __file__, "--child", "overhead", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if r.returncode != 0:
        raise SystemExit(f"overhead failed:\n{r.stderr[-3000:]}")
    overhead = json.loads(r.stdout.strip().splitlines()[-1])
    print(
        f"per-step overhead of the CloudML trainer: {overhead['overhead_ms_per_step']:.2f} ms "
        f"({overhead['overhead_ratio']:.3f}x the bare step; pairs {overhead['pair_ratio_q1']:.3f}.."
        f"{overhead['pair_ratio_q3']:.3f})"
    )
    resume = resume_runs()
    steps = EPOCHS * 39
    result = {
        "machine": machine(),
        "epochs": EPOCHS,
        "optimizer_steps": steps,
        "repeats": REPEATS,
        "summary": summary,
        "per_step_overhead": overhead,
        "resume": {"every_steps": RESUME_EVERY, "killed_at_step": KILL_STEP, **resume},
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
