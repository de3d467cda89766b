"""Training: `train(cfg, run_dir)` runs one run (or the two-phase protocol) and returns its report.

- build.py       the ordered set-up: data, run folder, model, precision, DDP, compile, optimizer, loader
- loop.py        the Trainer: fit -> epoch -> step, on one screen
- state.py       what survives a restart, each piece behind state_dict()/load_state_dict() by key
- saving.py      checkpoint cadence, the manifest, best.pt
- evaluation.py  validation after each epoch, the best model, the end of a run
- progress.py    run.json and the notebook's progress lines;  signals.py  stopping on SIGTERM/Ctrl-C
- loss.py        the objective: weighted Huber on the standardised height
- phases.py      the command: one run or pre-train + fine-tune; a torchrun peer's failure explained
"""

from cloudml_lib.train.build import lr_factor, seed_everything
from cloudml_lib.train.loop import Trainer
from cloudml_lib.train.loss import batch_loss, weighted_huber
from cloudml_lib.train.phases import train, train_two_phase
from cloudml_lib.train.progress import ProgressLines

__all__ = [
    "ProgressLines",
    "Trainer",
    "batch_loss",
    "lr_factor",
    "seed_everything",
    "train",
    "train_two_phase",
    "weighted_huber",
]
