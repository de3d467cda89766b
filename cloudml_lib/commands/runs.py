"""A run, from its start to its end: `train_run` pairs training (train/, which ends at the final
checkpoint) with the end of the run (science/finish.py: the test flights' evaluation, the cloud probe, the
intervals, the report). It is the one route for `train`, each phase of the two-phase protocol (pre-train on
one flight, then fine-tune), each cross-validation fold and each sweep trial; every part of it resumes. In a
torchrun job, a peer's failure is explained in plain words; a run that stops on an error says so in its
run.json (status.run_state: "failed")."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from cloudml_lib.base.config import Config, derive
from cloudml_lib.base.errors import CloudMLError, ConfigError
from cloudml_lib.core.machine.distributed import SINGLE, Dist, explain_peer_failure, init_distributed
from cloudml_lib.core.run.folder import RunFolder
from cloudml_lib.core.run.runfolder import RUN
from cloudml_lib.data.flights import resolve_config
from cloudml_lib.data.synthetic import ensure_demo_flights
from cloudml_lib.science.finish import finish_run
from cloudml_lib.train.build import check_run_folder
from cloudml_lib.train.loop import Trainer

log = logging.getLogger(__name__)


def train_run(
    cfg: Config,
    folder: RunFolder | str | Path,
    resume: str = "auto",
    dist: Dist | None = None,
    after_epoch=None,
) -> dict:
    """A run trained and ended; its report. With train.pretrain_flight, the two-phase protocol (each phase
    resumable). `folder`: the run (a path is taken as one). `dist`: by default the torchrun job this
    process belongs to (or the single process). `after_epoch(history)`: a sweep's pruner, asked after each
    epoch of a one-phase run."""
    folder = RunFolder.of(folder)
    dist = init_distributed(cfg.train.device) if dist is None else dist
    try:
        check_run_folder(cfg, folder)  # a refused folder before the demo's flights are written (12 s)
        cfg = with_demo_flights(cfg, dist)
        return run_to_end(cfg, folder, resume, dist, after_epoch)
    except CloudMLError as e:
        if dist.is_main and folder.path.is_dir():
            folder.record_failure(str(e))
        raise
    except (Exception, KeyboardInterrupt) as e:  # torchrun's SIGTERM may follow a peer's death
        message = explain_peer_failure(e, dist)
        if message is None:
            raise
        raise CloudMLError(message) from None
    finally:
        dist.close()


def with_demo_flights(cfg: Config, dist: Dist = SINGLE) -> Config:
    """Where a command starts: the demo flights written into data.dir when the config asks for the demo and
    they are not there (rank 0 first under torchrun), and the demo's test flight where the config names none.
    Nothing below the commands writes them (import-linter)."""
    if not cfg.data.demo:
        return cfg
    return replace(cfg, data=dist.main_first(lambda: ensure_demo_flights(cfg.data)))


def run_to_end(cfg: Config, folder: RunFolder, resume: str, dist: Dist, after_epoch=None) -> dict:
    """One phase, or the two-phase protocol with train.pretrain_flight (whose phases a pruner does not stop):
    trained and ended, in this job's processes (`dist` stays open: a sweep runs its trials in it)."""
    if cfg.train.pretrain_flight:
        return train_two_phase(cfg, folder, resume, dist)
    return train_and_finish(cfg, folder, resume, dist, after_epoch=after_epoch)


def train_and_finish(
    cfg: Config, folder: RunFolder, resume: str, dist: Dist, init_from: Path | None = None, after_epoch=None
) -> dict:
    """Train to the final checkpoint, then the end of the run: its report."""
    Trainer(cfg, folder, resume, init_from=init_from, dist=dist).setup().fit(after_epoch)
    return finish_run(folder, dist)


def check_pretrain_flight(cfg: Config, names: list[str]) -> list[str]:
    """The pre-training flight is a training flight, and the over-weighted one if one is named."""
    p = cfg.train.pretrain_flight
    if not p:
        return []
    if p not in names:
        return [f"train.pretrain_flight: {p!r} is not one of the flights ({', '.join(names)})"]
    if p in cfg.data.test_flights:
        return [f"train.pretrain_flight: {p!r} is a test flight; pre-train on a training flight"]
    if isinstance(cfg.data.validation, list) and p in cfg.data.validation:
        return [
            f"train.pretrain_flight: {p!r} is a validation flight (data.validation); pre-train on another"
        ]
    if cfg.data.overweight_flight and cfg.data.overweight_flight != p:
        return [
            f"train.pretrain_flight: {p!r} and data.overweight_flight {cfg.data.overweight_flight!r} differ; "
            "in the two-phase protocol the pre-training flight is the over-weighted one"
        ]
    return []


def train_two_phase(cfg: Config, folder: RunFolder, resume: str, dist: Dist = SINGLE) -> dict:
    """Phase 1 trains on train.pretrain_flight alone (RUN_DIR/pretrain, train.pretrain_epochs); phase 2
    fine-tunes from its best weights on all training flights, the pre-training flight weighted by
    data.overweight_factor (RUN_DIR). Each phase fits its own scalers on its own training flights.
    An interrupted phase resumes; a finished phase 1 is not trained again."""
    folder.check_run(trains=True, command="train")  # before phase 1 makes RUN_DIR/pretrain in it
    folder.claim(RUN)  # the two phases' folder, marked before phase 1 writes into it
    cfg, _ = resolve_config(cfg)
    names = [f.name for f in cfg.data.flights]
    problems = check_pretrain_flight(cfg, names)
    if problems:
        raise ConfigError("; ".join(problems))
    keep = {cfg.train.pretrain_flight, *cfg.data.test_flights}
    phase1 = derive(
        cfg,
        {
            "data.flights": [f for f in cfg.data.flights if f.name in keep],
            "data.overweight_flight": "",
            "train.pretrain_flight": "",
            "train.epochs": cfg.train.pretrain_epochs,
            # its one training flight: validated on the last part of it
            **({"data.validation": "auto"} if isinstance(cfg.data.validation, list) else {}),
        },
    )
    log.info("Phase 1 of 2: pre-training on %s for %d epochs", cfg.train.pretrain_flight, phase1.train.epochs)
    pretrain = RunFolder(folder.pretrain)
    train_and_finish(phase1, pretrain, resume, dist)
    phase2 = derive(cfg, {"data.overweight_flight": cfg.train.pretrain_flight})
    log.info(
        "Phase 2 of 2: fine-tuning on %s (%s weighted x%g)",
        ", ".join(n for n in names if n not in cfg.data.test_flights),
        cfg.train.pretrain_flight,
        cfg.data.overweight_factor,
    )
    return train_and_finish(phase2, folder, resume, dist, init_from=pretrain.best)
