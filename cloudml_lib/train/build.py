"""The ordered set-up of a run: what the loop needs, built once, in the order that matters.

1. data (rank 0 builds any missing cache; the others then read it) and its checks: a data or
   config error must not leave a run folder behind;
2. the run folder claimed: locked, leftovers cleaned, the checkpoint to resume from chosen and
   checked against this config and this data;
3. seeds, then the model (initial weights), on its device, BatchNorm over the global batch;
4. precision, decided once: autocast and a GradScaler (disabled, it passes values through), so the
   loop has no AMP branches;
5. DDP, the `auto` batch probe, then torch.compile (after the probe, whose copy of the model must
   not share the compiled encoder);
6. the optimizer over the parameters that will be trained (never re-allocated after), the
   scheduler, the sampler and the loader;
7. the start: every piece of state restored from the resume point (state.py), or a fresh run,
   from `init_from`'s weights when fine-tuning.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch.utils.data import DataLoader

from cloudml_lib.base import faults
from cloudml_lib.base.config import Config, derive, save_config
from cloudml_lib.base.errors import CloudMLError, ConfigError
from cloudml_lib.base.logs import attach_run_log, to_run_log
from cloudml_lib.core.machine.determinism import apply_determinism
from cloudml_lib.core.machine.device import (
    Precision,
    choose_device,
    choose_precision,
    default_num_workers,
    describe_device,
)
from cloudml_lib.core.machine.distributed import Dist, apply_ddp, apply_global_batchnorm
from cloudml_lib.core.machine.estimate import StepShape, estimate
from cloudml_lib.core.machine.memory import GIB, measure_batch_size
from cloudml_lib.core.machine.timing import Measured, calibration, device_name, signature
from cloudml_lib.core.network.compile import CompileWatch, apply_compile
from cloudml_lib.core.network.model import (
    MultimodalRegressionModel,
    build_model,
    count_parameters,
    training_memory_format,
)
from cloudml_lib.core.run.checkpoint import CheckpointWriter, Found, Key, check_folder, load_checkpoint
from cloudml_lib.core.run.events import Events
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.provenance import read_run_provenance, run_provenance, trained_backend
from cloudml_lib.core.run.resume import (
    check_data_fingerprint,
    check_resume_config,
    recorded_files,
    resumed_config,
)
from cloudml_lib.core.run.runfolder import RUN, MetricsFile, truncate_metrics
from cloudml_lib.core.run.runlock import RunLock
from cloudml_lib.data import domain
from cloudml_lib.data.cache import cache_root
from cloudml_lib.data.dataset import (
    CloudDataset,
    EpochBatchSampler,
    RunData,
    Scalers,
    prepare_data,
    quick_subset,
    split_data,
)
from cloudml_lib.data.flights import resolve_config
from cloudml_lib.data.preprocess import resolve_backend
from cloudml_lib.train.averaging import WeightAverage, resolve_decay
from cloudml_lib.train.progress import RunInfo
from cloudml_lib.train.saving import Checkpoints
from cloudml_lib.train.state import LoopState, TrainingState, stateful

log = logging.getLogger(__name__)


def resolved(size: int | str | None, what: str = "train.batch_size") -> int:
    """A size the build has settled ("auto" measured, None filled in) by the time it is used."""
    if not isinstance(size, int) or isinstance(size, bool):
        raise RuntimeError(f"{what} is {size!r} where the build has settled it")
    return size


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based): linear warm-up, then cosine decay."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


MAX_WARMUP_SHARE = 0.2  # the warm-up takes at most this share of a run's optimizer steps


def fitted_warmup(warmup_steps: int, total_steps: int) -> int:
    """train.warmup_steps, shortened to MAX_WARMUP_SHARE of the run where it is longer: a run shorter than its
    warm-up would never reach its learning rate (a 12-step try-out run with the presets' 200 steps)."""
    return min(warmup_steps, max(1, math.ceil(MAX_WARMUP_SHARE * total_steps))) if warmup_steps else 0


def use_warmup(parts: Parts, progress, cfg: Config) -> None:
    """The warm-up a run keeps for its whole life: fitted to its length at its first start and saved with its
    progress; a run saved before warm-ups were fitted keeps train.warmup_steps as it was (its reading)."""
    if progress.warmup_steps is None:
        progress.warmup_steps = cfg.train.warmup_steps if progress.step else parts.warmup_steps
    if not isinstance(progress.warmup_steps, int) or not 0 <= progress.warmup_steps <= 10_000_000:
        raise CloudMLError(
            f"the checkpoint's loop state holds warmup_steps {str(progress.warmup_steps)[:40]!r}, expected a "
            "whole number from 0 to 10000000; resume from another checkpoint (--resume PATH)"
        )
    if progress.step == 0 and parts.warmup_steps < cfg.train.warmup_steps:
        log.info(
            "Warm-up: %d optimizer steps, not train.warmup_steps' %d: a warm-up takes at most %.0f%% of the "
            "run's %d steps, so that its learning rate is reached",
            parts.warmup_steps,
            cfg.train.warmup_steps,
            100 * MAX_WARMUP_SHARE,
            parts.total_steps,
        )
    if progress.warmup_steps != parts.warmup_steps:  # a resumed run: the warm-up it started with
        parts.scheduler.lr_lambdas[0] = schedule(progress.warmup_steps, parts.total_steps, cfg)


def use_memory_format(parts: Parts, found: Found | None, dist: Dist, cfg: Config) -> None:
    """The model's memory format for the run's whole life (train.memory_format; auto: at its first start where
    a measurement of eager steps says it pays on this device, model.training_memory_format, a compiled run
    and DDP the default; a resumed run keeps its own, an older run the default)."""
    setting = cfg.train.memory_format
    if setting != "auto":
        use, why = setting == "channels_last", f"{setting} (train.memory_format)"
    elif found is not None:
        saved = (found.state or {})[Key.LOOP].get("channels_last")
        use = saved is True
        why = (
            f"{'channels_last' if use else 'the default'}, the run's own since its first start"
            if saved is not None
            else "the default (a run started before the format was chosen by measurement)"
        )
    elif dist.active:
        use, why = False, "the default (several processes: DDP lays out its buckets for it)"
    elif cfg.train.torch_compile:
        use = False
        why = (
            "the default (a compiled run: channels_last was measured on eager steps, and "
            "through the Trainer on a CPU compiled epochs were no faster in it)"
        )
    else:
        use, why = training_memory_format(parts.device)
    if use:
        # in place: the optimizer keeps its parameters (torch's stubs omit the keyword)
        parts.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    parts.channels_last = use
    log.info("Memory format: %s", why)


def schedule(warmup_steps: int, total_steps: int, cfg: Config):
    """The LR multiplier per optimizer step (a partial: the scheduler's saved state holds no settings)."""
    return partial(
        lr_factor, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=cfg.train.min_lr_ratio
    )


def check_batch_size(cfg: Config, n_train: int, world: int) -> None:
    """train.batch_size (the global batch) against the process count and the training set."""
    t, n = cfg.train, n_train
    if t.batch_size != "auto" and t.batch_size < world:
        raise ConfigError(
            f"train.batch_size {t.batch_size} is the global batch, shared by the {world} "
            f"processes: it must be at least {world}"
        )
    if t.batch_size != "auto" and t.batch_size * t.grad_accum_steps > n:
        fixes = (
            [f"train.batch_size <= {n // t.grad_accum_steps}"] if n // t.grad_accum_steps >= 1 else []
        ) + (
            [f"train.grad_accum_steps <= {n // t.batch_size} (with train.batch_size {t.batch_size})"]
            if n // t.batch_size >= 1
            else []
        )
        fix = " or ".join(fixes) or f"train.batch_size <= {n} with train.grad_accum_steps: 1"
        raise ConfigError(
            f"train.batch_size {t.batch_size} x train.grad_accum_steps {t.grad_accum_steps} = "
            f"{t.batch_size * t.grad_accum_steps} samples per optimizer step, larger than the training "
            f"set ({n} samples): every epoch would be a single step. Choose {fix}."
        )


def data_fingerprint(caches: list) -> dict:
    """What the run trains, validates and tests on, by content: per flight (its whole cache) its sample count
    and a hash of its labelled frames, labels and angles (and the atmosphere's predictors where the run reads
    them). A resumed run must see the same (file times may differ)."""
    out = {}
    for c in caches:
        h = hashlib.sha256()
        for a in (c.frame_index, c.cbh_km, c.cloud, c.sza_deg, c.saa_deg, c.heading_deg, c.windows):
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(str(c.meta.get("frames_sha256", c.meta.get("bytes"))).encode())
        if c.atmosphere is not None:  # the ERA5 predictors it reads: a file changed since is new data
            h.update(np.ascontiguousarray(c.atmosphere).tobytes())
            h.update(",".join(c.atmosphere_names).encode())
        files = {
            role: f.get("sha256") for role, f in (c.meta.get("files") or {}).items() if isinstance(f, dict)
        }
        out[c.name] = {"samples": len(c), "sha256": h.hexdigest()[:16], "files": files}
    return out


_SHOWN_TABLES: set[str] = set()  # the flight tables this process has put on screen


def show_flight_table(table: str) -> None:
    """The run's flight table, into its train.log always; on screen once per process: a cross-validation's
    control run (and the next fold's runs on the same flights) would print the same table again."""
    if table in _SHOWN_TABLES:
        to_run_log(f"Flights:\n{table}", logging.INFO)
        log.info("Flights: as in the table above (the same files, labels and filters; in train.log too)")
        return
    _SHOWN_TABLES.add(table)
    log.info("Flights:\n%s", table)


def claim_run_dir(
    cfg: Config, folder: RunFolder, resume: str, dist: Dist, fingerprint: dict, flight_table: str
) -> tuple[RunLock | None, Found | None, Config]:
    """Rank 0 locks the run folder, cleans leftovers, picks the checkpoint to resume from and checks this
    config and data against it; every other rank then loads that same committed checkpoint (its checksums
    verified again). Returns the lock (rank 0's; to release at the end), the checkpoint to resume from (if
    any), and the config the run goes on with (check_resume_config: `cfg` itself is not changed)."""
    lock = None

    def claim():
        nonlocal lock
        folder.claim(RUN)  # made (or adopted) and marked as CloudML's before anything is written
        lock = folder.lock()
        attach_run_log(folder)
        folder.clean_leftovers()
        found = folder.resume_point(resume)
        if found is not None:
            check_resume_config(cfg, found.state[Key.CONFIG])
            check_data_fingerprint(found.state.get(Key.FINGERPRINT), fingerprint, recorded_files(folder))
        show_flight_table(flight_table)
        return found

    try:
        found = dist.main_first(claim if dist.is_main else lambda: None)  # rank 0's error stops all
        point = dist.from_main(None if found is None else str(found.folder))
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if not dist.is_main and point is not None:
        reason, state, meta = check_folder(Path(point))
        if reason is not None:
            raise CloudMLError(
                f"rank {dist.rank} cannot read the checkpoint rank 0 resumes from, {point}: "
                f"{reason}. Every process must see the same run folder (a shared disk)."
            )
        found = Found(Path(point), state, [], meta or {})
    return lock, found, (cfg if found is None else resumed_config(cfg, found.state[Key.CONFIG]))


@dataclass
class Parts:
    """Steps 3-6 above: the model and everything that trains it."""

    model: torch.nn.Module  # the plain module: what is trained (and, without an average, evaluated)
    average: WeightAverage | None  # the EMA of its weights (train.ema_decay): what is evaluated and kept
    ddp: torch.nn.Module  # what a training step calls: the model, or DDP around it
    device: torch.device
    autocast: Callable  # a context manager factory: autocast, or nothing in float32
    scaler: torch.amp.GradScaler
    compile: CompileWatch
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    sampler: EpochBatchSampler
    loader_rng: torch.Generator  # the loader's worker seeds (kept apart from the global RNG)
    loader: DataLoader
    num_workers: int
    steps_per_epoch: int  # optimizer steps
    total_steps: int
    warmup_steps: int  # fitted to the run (fitted_warmup); a resumed run keeps its own (use_warmup)
    channels_last: bool = False  # the model's memory format (use_memory_format)


@dataclass
class Run:
    """What the loop needs, built in the order above; the Trainer assigns each of these to itself."""

    config: Config  # the run's plan: the config loaded, with its flights and batch size resolved
    train_set: CloudDataset
    val_set: CloudDataset
    quick_val: np.ndarray  # the validation samples scored after each epoch
    lock: RunLock | None  # rank 0's lock on the run folder
    parts: Parts
    loop: LoopState  # progress and loss sums: what the loop changes
    checkpoints: Checkpoints  # when to save, and the whole save in one call
    metrics: MetricsFile
    run_info: RunInfo
    events: Events


def build_run(cfg: Config, folder: RunFolder, resume: str, init_from: Path | None, dist: Dist) -> Run:
    """Everything in the order above; the run starts from the resume point, or from `init_from`'s weights
    (fine-tuning), or fresh. `cfg` is not changed: what the run resolves (its flights, a measured batch
    size) is in Run.config and run.json. On any error the run folder is released."""
    cfg, data, fingerprint, provenance = run_data(cfg, folder, dist)
    lock = writer = None
    try:
        lock, found, resumed = claim_run_dir(
            cfg, folder, resume, dist, fingerprint, data.train_set.flight_table
        )
        if resumed.data != cfg.data:  # a run of an earlier release keeps its reading of its data (its split)
            data = split_data(resumed, data.caches, data.train_set.flight_table)
        cfg, train_set, val_set = resumed, data.train_set, data.val_set
        if found is not None:  # the brightness statistics in the units the run started with
            saved = Scalers.from_dict((found.state or {})[Key.SCALERS])
            saved.check_units(train_set.scalers.radiometry_units or "", f"the flights of {folder.path}")
        header = run_header(train_set, fingerprint, provenance, data.split.record(), dist)
        seed_everything(cfg.train.seed)
        parts, cfg = build_parts(cfg, dist, train_set, folder.path.parent, kept_kernels(cfg, folder))
        writer = CheckpointWriter(folder, cfg.checkpoint.keep_last) if dist.is_main else None
        loop, metrics = (
            LoopState(dist, parts.device, resolved(cfg.train.batch_size)),
            folder.metrics_file(dist),
        )
        pieces = stateful(parts.model, parts.optimizer, parts.scheduler, parts.scaler, loop, parts.average)
        state = TrainingState(pieces, parts.loader_rng, parts.sampler, header, dist)
        checkpoints = Checkpoints(folder, cfg, dist, writer, state, metrics, parts.total_steps)
        step = StepShape.of(cfg, None, frame=train_set.caches[0].frame_shape)
        measured = Measured(device_name(parts.device), signature(step, resolved(cfg.train.batch_size)))
        if parts.device.type == "cuda":  # the estimate beside what the GPU holds: every run calibrates it
            measured.estimated_need_gib = estimated_need_gib(
                cfg, parts.device, train_set.caches[0].frame_shape
            )
        run_info = RunInfo(folder, dist, parts.compile, provenance, measured)
        if dist.is_main:
            save_config(cfg, folder.config)  # the run's plan, as it trains
        start(found, state, parts, metrics, run_info, cfg, init_from, data.split.record())
        checkpoints.events = Events(
            folder, writer.local_dir if writer else None, loop.progress.step, fresh=found is None
        )
    except BaseException:
        if writer is not None:
            writer.close()
        if lock is not None:
            lock.release()
        raise
    checkpoints.last_save = time.monotonic()
    return Run(
        config=cfg,
        train_set=train_set,
        val_set=val_set,
        quick_val=quick_validation(cfg, val_set),
        lock=lock,
        parts=parts,
        loop=loop,
        checkpoints=checkpoints,
        metrics=metrics,
        run_info=run_info,
        events=checkpoints.events,
    )


def run_header(train_set: CloudDataset, fingerprint, provenance, split: dict, dist: Dist) -> dict:
    """What every checkpoint and best.pt carry of the run's data: the scalers, the data's fingerprint and
    provenance, the span of the labels and the inputs trained on (the domain check), the split. Rank 0 alone
    writes them; the domain, which only they carry, is fitted there alone (its covariance estimator imports
    scikit-learn: about a second of every other process's start)."""
    header = {
        Key.SCALERS: train_set.scalers.to_dict(),
        Key.FINGERPRINT: fingerprint,
        Key.PROVENANCE: provenance,
        Key.LABEL_RANGE: label_range(train_set),
        Key.SPLIT: split,
    }
    if dist.is_main:
        header[Key.DOMAIN] = domain.of_dataset(train_set).to_dict()
    return header


def label_range(dataset: CloudDataset) -> list[float]:
    """[lowest, highest] height (km) among the labels a model is fitted on: a height outside lies where no
    label taught it (predict's qc)."""
    km = dataset.targets_km()[dataset.has_height()]
    return [float(km.min()), float(km.max())] if km.size else []


def check_cache_apart(cfg: Config, folder: RunFolder) -> None:
    """The preprocessing cache is a folder of its own, never the run folder or one inside it (a run's folder
    is cleaned, its caches are kept across runs)."""
    # the real paths, as the system finds them (os.path.realpath: a link loop is left as written, for the
    # folder's own check to name, where Path.resolve would raise)
    cache, run = (Path(os.path.realpath(p)) for p in (cache_root(cfg.data), folder.path))
    if cache == run or run in cache.parents:
        raise ConfigError(
            f"data.cache_dir {cache_root(cfg.data)} is the run folder {folder} or inside it; give the "
            "cache a "
            "folder of its own (e.g. cache/ beside runs/), shared by every run. Nothing was written."
        )


def check_run_folder(cfg: Config, folder: RunFolder) -> None:
    """The run folder can take this run (a folder, new or a run's own, apart from the cache), checked before
    anything is written for it: the demo's flights included (commands/runs.py), then again at the set-up."""
    run_dir = folder.path
    if run_dir.exists() and not run_dir.is_dir():
        raise CloudMLError(f"--run-dir {run_dir} is a file, not a folder; choose a folder for the run")
    check_cache_apart(cfg, folder)  # first: a cache in the folder is named as such, not as others' files
    folder.check_run(trains=True, command="train")


def run_data(cfg: Config, folder: RunFolder, dist: Dist) -> tuple[Config, RunData, dict, dict]:
    """Step 1: the run folder may hold a run; the flights resolved (a derived config), their caches (rank 0
    builds a missing one, the others then read it), the datasets by role, the batch size checked against
    them, and what the run trains on by content (fingerprint) and by origin (provenance)."""
    check_run_folder(cfg, folder)
    faults.point("setup")
    # a resumed run keeps the CLAHE backend it started with (auto), or is warned that it changes
    backend = resolve_backend(cfg.data.preprocess_device, trained_backend(read_run_provenance(folder)))

    def data():
        resolved, skipped = resolve_config(cfg)
        return resolved, prepare_data(resolved, skipped, backend)

    cfg, prepared = dist.main_first(data)
    check_batch_size(cfg, len(prepared.train_set), dist.world)
    fingerprint = data_fingerprint(prepared.caches)  # fixed for the run; stored in every checkpoint
    return cfg, prepared, fingerprint, run_provenance(prepared.caches, cfg.data)


def quick_validation(cfg: Config, val_set: CloudDataset) -> np.ndarray:
    """The validation samples scored after each epoch: a fixed share, evenly spread. Until the probe is fitted
    the model answers the height alone: each epoch then scores the frames with a height."""
    scored = np.arange(len(val_set))
    if cfg.model.cloud_head == "probe":
        scored = np.flatnonzero(val_set.has_height())
    return scored[quick_subset(len(scored), cfg.train.quick_val_fraction)]


def placed_model(cfg: Config, dist: Dist, scalers) -> tuple[torch.nn.Module, torch.device, Precision]:
    """The model (initial weights; its bounded height range placed by the run's `scalers`) on this process's
    device, BatchNorm over the global batch with several processes, and the precision decided once for the
    device."""
    model = build_model(cfg, scalers)
    model.set_grad_checkpointing(cfg.model.gradient_checkpointing)
    device = choose_device(cfg.train.device)
    if device.type == "cuda" and dist.active:
        device = torch.device("cuda", dist.local_rank)
    log.info(
        "Deterministic algorithms (train.deterministic): %s",
        apply_determinism(cfg.train.deterministic, device),
    )
    model.to(device)
    if dist.active:
        model = cast(MultimodalRegressionModel, apply_global_batchnorm(model, device))  # the same module
    return model, device, choose_precision(device)


def estimated_need_gib(cfg: Config, device: torch.device, frame: tuple[int, int]) -> float | None:
    """The estimate's GPU memory need of this run's step at its batch (None where it cannot estimate)."""
    found = estimate(StepShape.of(cfg, _amp_name(choose_precision(device)), frame=frame))
    return found.need(int(cfg.train.batch_size)) / GIB if found else None


def _amp_name(precision) -> str | None:
    return str(precision.dtype).removeprefix("torch.") if precision.dtype else None


def auto_batch_size(
    cfg: Config, model, precision: Precision, frame: tuple[int, int], runs: Path | None
) -> int:
    """train.batch_size auto for this process: the probe's measurement, logged beside the estimate's first
    guess on a GPU, itself calibrated by an earlier run in `runs` on this kind of GPU where there is one."""
    device = next(model.parameters()).device
    guess = estimate(StepShape.of(cfg, _amp_name(precision), frame=frame)) if device.type == "cuda" else None
    calibrated = None
    if guess is not None and runs is not None:
        sig = signature(StepShape.of(cfg, None, frame=frame), 0)
        calibrated = calibration(runs, device_name(device), sig, lambda b: guess.need(b) / GIB)
    autocast = precision.autocast(device)
    return measure_batch_size(model, autocast, device, cfg.data.temporal_frames, frame, guess, calibrated)


def kept_kernels(cfg: Config, folder: RunFolder) -> Path:
    """Where a compiled run keeps its kernels for the next machine: train.compile_cache_dir, else the run
    folder's compile_cache/ (core/network/compile_cache.py)."""
    return Path(cfg.train.compile_cache_dir) if cfg.train.compile_cache_dir else folder.compile_cache


def build_parts(
    cfg: Config, dist: Dist, train_set: CloudDataset, runs: Path | None = None, kernels: Path | None = None
) -> tuple[Parts, Config]:
    """Steps 3-6 above, after the seeds are set; and the config with `train.batch_size: auto` measured (a new
    Config: `cfg` is not changed). `runs`: the folder of the user's runs, whose measurements on this kind of
    GPU calibrate the batch probe's first guess; `kernels`: where compiled kernels are kept (kept_kernels)."""
    t = cfg.train
    model, device, precision = placed_model(cfg, dist, train_set.scalers)
    # the average is a copy of the model made before DDP wraps it or compile changes its encoder's forward
    average = WeightAverage(model) if t.ema_decay != 0 else None
    autocast = precision.autocast(device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision.use_grad_scaler)
    ddp = apply_ddp(model, dist, device, unused_parameters=cfg.model.scalars_only) if dist.active else model
    if t.batch_size == "auto":  # per process; the global batch is what every process can hold
        per_process = auto_batch_size(cfg, model, precision, train_set.caches[0].frame_shape, runs)
        cfg = derive(cfg, {"train.batch_size": min(dist.gather(per_process)) * dist.world})
        t = cfg.train
    sampler = EpochBatchSampler(
        len(train_set), resolved(t.batch_size), t.seed, rank=dist.rank, world=dist.world
    )
    steps_per_epoch = math.ceil(sampler.batches_per_epoch() / t.grad_accum_steps)
    total_steps = steps_per_epoch * t.epochs
    if average is not None:
        average.decay = resolve_decay(t.ema_decay, total_steps)
    watch = apply_compile(model, t.torch_compile, t.torch_compile_mode, device, kernels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.learning_rate, weight_decay=t.weight_decay)
    if dist.active:
        torch.manual_seed(t.seed + dist.rank)  # each process its own dropout masks
    warmup_steps = fitted_warmup(t.warmup_steps, total_steps) if t.warmup_fit else t.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(warmup_steps, total_steps, cfg))
    # The loader draws its worker seed from its own generator, not the global RNG, so that
    # starting a fresh iterator on resume does not shift the dropout masks that follow.
    loader_rng = torch.Generator().manual_seed(t.seed)
    num_workers = default_num_workers() if cfg.data.num_workers == "auto" else cfg.data.num_workers
    loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=device.type == "cuda",
        generator=loader_rng,
    )
    describe_parts(cfg, model, device, precision, dist, steps_per_epoch, num_workers)
    if average is not None:
        log.info("%s", average.describe(total_steps))
    return Parts(
        model=model,
        average=average,
        ddp=ddp,
        device=device,
        autocast=autocast,
        scaler=scaler,
        compile=watch,
        optimizer=optimizer,
        scheduler=scheduler,
        sampler=sampler,
        loader_rng=loader_rng,
        loader=loader,
        num_workers=num_workers,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
    ), cfg


def describe_parts(
    cfg: Config,
    model,
    device: torch.device,
    precision: Precision,
    dist: Dist,
    steps_per_epoch: int,
    num_workers: int,
) -> None:
    log.info(
        "model: %s parameters, channels %s, gradient checkpointing %s; device %s, precision %s; batch %d%s, "
        "%d optimizer steps per epoch, %d loader workers",
        f"{count_parameters(model):,}",
        cfg.channels,
        "on" if cfg.model.gradient_checkpointing else "off",
        describe_device(device),
        precision.name,
        cfg.train.batch_size,
        f" over {dist.world} processes{on_machines(dist)} (BatchNorm over the whole batch)"
        if dist.active
        else "",
        steps_per_epoch,
        num_workers,
    )


def start(
    found: Found | None,
    state: TrainingState,
    parts: Parts,
    metrics: MetricsFile,
    run_info: RunInfo,
    cfg: Config,
    init_from: Path | None,
    split: dict,
) -> None:
    """From the resume point; or fresh (an empty metrics file), from `init_from`'s weights if given. run.json
    records the plan of this start: what was resolved, and how (`split`: which data play which role, as
    splits.Split.record says). Eight parameters: the pieces start touches, each its own concern."""
    use_memory_format(parts, found, state.dist, cfg)
    if found is not None:
        state.restore(found, metrics.path, cfg)
    else:
        if state.dist.is_main:  # the file's only writer (MetricsFile)
            truncate_metrics(metrics.path, 0)
        if init_from is not None:
            parts.model.load_state_dict(load_checkpoint(init_from)[Key.MODEL])  # in place
            log.info("Starting from the weights of %s", init_from)
    use_warmup(parts, state.progress, cfg)
    state.progress.channels_last = parts.channels_last
    run_info.start(
        {
            "processes": state.dist.world,
            "machines": state.dist.machines,
            "total_steps": parts.total_steps,
            "steps_per_epoch": parts.steps_per_epoch,
            "epochs": cfg.train.epochs,
            "batch_size": cfg.train.batch_size,
            "device": describe_device(parts.device),
            "start_step": state.progress.step,
            "resumed_from": str(found.folder) if found is not None else None,
            "flights": [f.name for f in cfg.data.flights],
            "test_flights": list(cfg.data.test_flights),
            "split": split,
        },
        found is not None,
    )


def on_machines(dist: Dist) -> str:
    return f" on {dist.machines} machines" if dist.machines > 1 else ""
