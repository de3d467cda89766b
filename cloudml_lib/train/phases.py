"""A training command: one run, or the two-phase protocol (pre-train on one flight, then fine-tune),
each phase an ordinary resumable run; in a torchrun job, a peer's failure explained in plain words."""

from __future__ import annotations

import logging
from pathlib import Path

from cloudml_lib.config import Config, derive
from cloudml_lib.data.flights import resolve_config
from cloudml_lib.distributed import SINGLE, Dist, explain_peer_failure, init_distributed
from cloudml_lib.errors import CloudMLError, ConfigError
from cloudml_lib.rundir import check_folder_kind
from cloudml_lib.train.loop import Trainer

log = logging.getLogger(__name__)


def train(cfg: Config, run_dir: str | Path, resume: str = "auto", dist: Dist | None = None) -> dict:
    """One run; with train.pretrain_flight, the two-phase protocol (each phase resumable).
    `dist`: by default the torchrun job this process belongs to (or the single process)."""
    dist = init_distributed(cfg.train.device) if dist is None else dist
    try:
        if not cfg.train.pretrain_flight:
            return Trainer(cfg, run_dir, resume, dist=dist).setup().fit()
        return train_two_phase(cfg, Path(run_dir), resume, dist)
    except Exception as e:
        message = explain_peer_failure(e, dist)
        if message is None:
            raise
        raise CloudMLError(message) from None
    finally:
        dist.close()


def check_pretrain_flight(cfg: Config, names: list[str]) -> list[str]:
    """The pre-training flight is a training flight, and the over-weighted one if one is named."""
    p = cfg.train.pretrain_flight
    if not p:
        return []
    if p not in names:
        return [f"train.pretrain_flight: {p!r} is not one of the flights ({', '.join(names)})"]
    if p in cfg.data.validation_flights:
        return [f"train.pretrain_flight: {p!r} is a validation flight; pre-train on a training flight"]
    if cfg.data.overweight_flight and cfg.data.overweight_flight != p:
        return [
            f"train.pretrain_flight: {p!r} and data.overweight_flight {cfg.data.overweight_flight!r} differ; "
            "in the two-phase protocol the pre-training flight is the over-weighted one"
        ]
    return []


def train_two_phase(cfg: Config, run_dir: Path, resume: str, dist: Dist = SINGLE) -> dict:
    """Phase 1 trains on train.pretrain_flight alone (RUN_DIR/pretrain, train.pretrain_epochs); phase 2
    fine-tunes from its best weights on all training flights, the pre-training flight weighted by
    data.overweight_factor (RUN_DIR). Each phase fits its own scalers on its own training flights.
    An interrupted phase resumes; a finished phase 1 is not trained again."""
    check_folder_kind(run_dir, "train")  # before phase 1 makes RUN_DIR/pretrain in it
    cfg, _ = resolve_config(cfg)
    names = [f.name for f in cfg.data.flights]
    problems = check_pretrain_flight(cfg, names)
    if problems:
        raise ConfigError("; ".join(problems))
    keep = {cfg.train.pretrain_flight, *cfg.data.validation_flights}
    phase1 = derive(
        cfg,
        {
            "data.flights": [f for f in cfg.data.flights if f.name in keep],
            "data.overweight_flight": "",
            "train.pretrain_flight": "",
            "train.epochs": cfg.train.pretrain_epochs,
        },
    )
    log.info("Phase 1 of 2: pre-training on %s for %d epochs", cfg.train.pretrain_flight, phase1.train.epochs)
    Trainer(phase1, run_dir / "pretrain", resume, dist=dist).setup().fit()
    phase2 = derive(cfg, {"data.overweight_flight": cfg.train.pretrain_flight})
    log.info(
        "Phase 2 of 2: fine-tuning on %s (%s weighted x%g)",
        ", ".join(n for n in names if n not in cfg.data.validation_flights),
        cfg.train.pretrain_flight,
        cfg.data.overweight_factor,
    )
    return (
        Trainer(phase2, run_dir, resume, init_from=run_dir / "pretrain" / "best.pt", dist=dist).setup().fit()
    )
