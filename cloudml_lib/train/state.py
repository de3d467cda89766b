"""What survives a restart: each piece behind `state_dict()` / `load_state_dict()` under a constant key.

A checkpoint's state.pt is `{key: piece.state_dict()}` for the pieces `stateful` registers (model,
optimizer, scheduler, scaler, loop: checkpoint.PIECES), every RNG of every process, and a header saying
what the run is (config, scalers, data fingerprint, provenance, metrics file length), under the keys of
checkpoint.Key, which the verifier checks. `TrainingState` is that whole, saved (`snapshot`) and restored
(`restore`) in one object; the loop's position is a typed `Progress`.
Adding a piece of state is one entry in that registry. Everything is CPU tensors and plain types,
so a checkpoint loads with `weights_only=True`.

Resume is exact: the loop's progress is one object, the data order is a function of (seed, epoch)
sliced at the saved batch, and every RNG, the optimizer, scheduler and scaler are restored. A run
killed at any moment and resumed ends bit-identical to one never interrupted.
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path
from typing import cast

import numpy as np
import torch

from cloudml_lib.base.config import Config
from cloudml_lib.base.errors import CloudMLError
from cloudml_lib.core.machine.distributed import Dist
from cloudml_lib.core.network.compile import unwrap_model
from cloudml_lib.core.network.inference import eval_batch_size
from cloudml_lib.core.run.checkpoint import FORMAT_VERSION, PIECES, Found, Key, read_meta, to_cpu
from cloudml_lib.core.run.progress import Progress
from cloudml_lib.core.run.runfolder import truncate_metrics

log = logging.getLogger(__name__)


class LoopState:
    """The progress dict and the device-side loss sums of the epoch and of the log window (summed
    without a device sync per batch). Saved as the sums over all processes; on restore rank 0
    carries them on and the others add from zero."""

    def __init__(self, dist: Dist, device: torch.device, batch_size: int):
        self.dist, self.device = dist, device
        # out of memory halves these; a resumed run restores its own
        self.progress = Progress(micro_batch_size=batch_size, eval_batch_size=eval_batch_size(batch_size))
        self.acc: dict = {}
        self.reset_epoch()
        self.reset_window()

    def reset_epoch(self) -> None:
        self.acc["epoch_loss"] = torch.zeros((), device=self.device)
        self.acc["epoch_batches"] = torch.zeros((), device=self.device)

    def add(self, loss: torch.Tensor, ok: torch.Tensor, samples: int) -> None:
        """One batch's loss into the epoch's and the log window's sums (a NaN batch adds nothing; no sync)."""
        acc = self.acc
        acc["epoch_loss"] += torch.where(ok, loss, 0.0)
        acc["window_loss"] += torch.where(ok, loss, 0.0)
        acc["epoch_batches"] += ok
        acc["window_batches"] += ok
        acc["window_samples"] += samples

    def reset_window(self) -> None:
        self.acc["window_loss"] = torch.zeros((), device=self.device)
        self.acc["window_batches"] = torch.zeros((), device=self.device)
        self.acc["window_samples"] = 0
        self.window_t0 = time.time()  # not saved: a resumed window's rate starts anew

    def state_dict(self) -> dict:
        """Collective: every process calls it (the sums are over all of them)."""
        acc: dict[str, torch.Tensor | int] = {
            k: self.dist.all_sum(v) for k, v in self.acc.items() if isinstance(v, torch.Tensor)
        }
        acc["window_samples"] = self.dist.sum_int(self.acc["window_samples"], self.device)
        return dict(self.progress.state_dict(), acc=acc)

    def load_state_dict(self, saved: dict) -> None:
        saved = dict(saved)
        self.acc = {
            k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) * self.dist.is_main
            for k, v in saved.pop("acc").items()
        }
        self.progress.load_state_dict(saved)  # in place: the Trainer's `progress` is this object


class Weights:
    """The plain model's weights (no `_orig_mod.` keys); loaded in place into the existing parameters."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        return dict(unwrap_model(self.model).state_dict())

    def load_state_dict(self, saved: dict) -> None:
        self.model.load_state_dict(saved)


def stateful(model, optimizer, scheduler, scaler, loop: LoopState, average=None) -> dict:
    """What a checkpoint holds, by constant key (checkpoint.PIECES, and the weights' average under Key.EMA
    where the run keeps one): a new piece of state (a second output's head, a tracker's position) is one more
    entry here."""
    pieces = {
        Key.MODEL: Weights(model),
        Key.OPTIMIZER: optimizer,
        Key.SCHEDULER: scheduler,
        Key.SCALER: scaler,
        Key.LOOP: loop,
    }
    assert tuple(pieces) == PIECES, "the pieces a checkpoint holds are checkpoint.PIECES"
    if average is not None:
        pieces[Key.EMA] = average
    return pieces


class TrainingState:
    """Everything a checkpoint saves and a resume restores, in one object: the pieces (`stateful`: model,
    optimizer, scheduler, scaler, loop) each under its constant key, the loader's RNG and the sampler's
    position, every process's RNGs, and the run's header (scalers, data fingerprint, provenance)."""

    def __init__(self, pieces: dict, loader_rng: torch.Generator, sampler, header: dict, dist: Dist):
        self.pieces, self.loader_rng, self.sampler, self.header, self.dist = (
            pieces,
            loader_rng,
            sampler,
            header,
            dist,
        )

    @property
    def progress(self) -> Progress:
        return self.pieces[Key.LOOP].progress

    def snapshot(self, run: dict) -> dict:
        """Everything a bit-exact resume needs, as CPU copies (a writer thread serialises it while the loop
        goes on). Every process calls it, in the same order (collectives inside); rank 0 gets the state, the
        others {}. Rank 0's RNGs are under Key.RNG, every process's under Key.RNG_RANKS (with several).
        `run`: the header's part that changes (config, metrics file length)."""
        states = {key: piece.state_dict() for key, piece in self.pieces.items()}
        rng_ranks = self.dist.gather(capture_rng(self.loader_rng))
        if not self.dist.is_main:
            return {}
        progress = self.progress
        return {
            Key.FORMAT: FORMAT_VERSION,
            **to_cpu(states),
            Key.RNG: rng_ranks[0],
            Key.RNG_RANKS: rng_ranks if len(rng_ranks) > 1 else None,
            Key.SAMPLER: {
                "seed": self.sampler.seed,
                "epoch": progress.epoch,
                "position": progress.batch,
                "samples": self.sampler.samples_before(progress.batch),
            },
            Key.PROCESSES: self.dist.world,
            **self.header,
            **run,
        }

    def restore(self, found: Found, metrics_path: Path, cfg: Config) -> None:
        """Each registered piece from its key, this process's RNGs, the metrics file cut back to the
        checkpoint's length; a finished run given more epochs carries on."""
        saved, dist = found.state, self.dist
        assert saved is not None and found.folder is not None  # a checkpoint that verified, loaded
        for key, piece in self.pieces.items():
            if key == Key.EMA and key not in saved:
                raise CloudMLError(
                    f"{found.folder} holds no average of the weights, but this run keeps one "
                    "(train.ema_decay): the checkpoint was not written by this run's settings. Resume with "
                    "the settings it was saved with, or use another --run-dir. Nothing was changed."
                )
            piece.load_state_dict(saved[key])
        per_rank = saved.get(Key.RNG_RANKS) or [saved[Key.RNG]]
        if len(per_rank) != dist.world:
            log.warning(
                "This run was saved by %d process(es) and resumes with %d: the data order and batches are "
                "the same, the dropout random streams start anew (the result is not bit-identical to an "
                "uninterrupted run).",
                len(per_rank),
                dist.world,
            )
        restore_rng(per_rank[dist.rank % len(per_rank)], self.loader_rng)
        st = self.progress
        if st.trained and cfg.train.epochs > saved[Key.CONFIG]["train"]["epochs"] and not st.stopped_early:
            st.trained = False  # more epochs asked for: carry on
        # the records after the checkpoint are work to redo (a trained run redoes none); by the file's only
        # writer: two processes of a job cutting it at once had one refuse it as changed by someone else
        if not st.trained and dist.is_main:
            truncate_metrics(metrics_path, saved[Key.METRICS_BYTES])
        where = (
            "trained"
            if st.trained
            else f"epoch {st.epoch + 1}, batch {st.batch}/{self.sampler.batches_per_epoch()}"
        )
        rejected = f"; rejected {len(found.rejected)} checkpoint(s)" if found.rejected else ""
        log.info(
            "Resumed from step %d (%s), saved %s%s",
            st.step,
            where,
            ago(time.time() - read_meta(found.folder)["saved_at"]),
            rejected,
        )


def ago(seconds: float) -> str:
    return f"{seconds:.0f} s ago" if seconds < 120 else f"{seconds / 60:.0f} min ago"


def capture_rng(*generators: torch.Generator) -> dict:
    """Every random number generator a resumed run must continue exactly."""
    name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())  # the legacy form: a tuple
    return {
        "python": random.getstate(),
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
        "generators": [g.get_state() for g in generators],
    }


def restore_rng(state: dict, *generators: torch.Generator) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    for g, s in zip(generators, state["generators"]):
        g.set_state(s)
