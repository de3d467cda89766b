"""Where a run stands in its training: the one typed reading of the progress every checkpoint saves.

Plain data, no torch: the trainer keeps it (train/state.py), and everything that reads a saved run (the run's
end in science/finish.py, the resume point and `status` in run/status.py) reads it as a `Progress`, never by
string keys. The attribute that means "trained to its last epoch (or stopped early)" is `trained`; it is
saved under "finished", the key of every earlier release's checkpoints (SAVED_AS), so old runs load as they
are. "finished" as a word for a run's state means more (trained and evaluated: status.run_state).
"""

from __future__ import annotations

import copy
import math
import uuid
from dataclasses import dataclass, field, fields

from cloudml_lib.core.run.checkpoint import Key

# An attribute saved under another key: the key every earlier release wrote.
SAVED_AS = {"trained": "finished"}


@dataclass
class Progress:
    """Where a run is: its position, its best model so far, its history and its recoveries. Saved in every
    checkpoint as plain types under these names (the keys of every earlier release's checkpoints: one missing
    from an older run takes its default here, and no class name is ever written)."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps taken
    batch: int = 0  # batches of the current epoch done
    best_val_loss: float = math.inf
    best_epoch: int = 0
    bad_epochs: int = 0  # epochs since the best (early stopping)
    history: list = field(default_factory=list)  # one record per epoch: its losses, metrics, time
    trained: bool = False  # trained to its last epoch (or stopped early): what is left is the run's end
    stopped_early: bool = False
    micro_batch_size: int | None = None  # halved by out of memory in training
    eval_batch_size: int | None = None  # halved by out of memory in evaluation
    oom_recoveries: int = 0
    nonfinite_in_a_row: int = 0
    nonfinite_total: int = 0
    # whether it trains in channels_last memory format (chosen at its first start); None: an older run (not)
    channels_last: bool | None = None
    # the warm-up this run took (fitted to its length at its first start); None: a run saved before that
    warmup_steps: int | None = None
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # which run a checkpoint belongs to

    def state_dict(self) -> dict:
        return {SAVED_AS.get(f.name, f.name): copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    def load_state_dict(self, saved: dict) -> None:
        for f in fields(self):
            key = SAVED_AS.get(f.name, f.name)
            if key in saved:
                setattr(self, f.name, copy.deepcopy(saved[key]))

    @classmethod
    def of(cls, state: dict) -> Progress:
        """The progress a loaded checkpoint (or best.pt) saved, under Key.LOOP; an older run's missing
        fields take their defaults (a run without a saved id: none, not a new one)."""
        saved = state[Key.LOOP]
        progress = cls(run_id="")
        progress.load_state_dict(saved)
        return progress
