"""Training: the Trainer runs a run to its final checkpoint (commands/runs.py pairs it with the run's end).

- build.py       the ordered set-up: data, run folder, model, precision, DDP, compile, optimizer, loader
- loop.py        the Trainer: fit -> epoch -> step, on one screen
- state.py       what survives a restart, each piece behind state_dict()/load_state_dict() by key
- saving.py      checkpoint cadence, the manifest, best.pt
- evaluation.py  validation after each epoch, the best model, early stopping
- averaging.py   the moving average of the weights (train.ema_decay): what is validated and kept
- progress.py    run.json and the notebook's progress lines;  signals.py  stopping on SIGTERM/Ctrl-C
- loss.py        the objective: weighted Huber on the standardised height (and the validation loss)
- nonfinite.py   a NaN/inf loss: the step skipped and counted, the caches checked for bit rot

May import: core, data, base (never science, commands or colab: pyproject.toml's import-linter contracts).
"""

from cloudml_lib.train.build import lr_factor, seed_everything
from cloudml_lib.train.loop import Trainer
from cloudml_lib.train.loss import batch_loss, weighted_huber
from cloudml_lib.train.progress import ProgressLines

__all__ = ["ProgressLines", "Trainer", "batch_loss", "lr_factor", "seed_everything", "weighted_huber"]
