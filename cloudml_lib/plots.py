"""Training curves and predicted-vs-true scatter, as PNG files and for live notebook display."""
from __future__ import annotations

from pathlib import Path

import matplotlib

if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "inline"):
    matplotlib.use("Agg")                         # headless by default; notebooks keep their own backend
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def curves_figure(history: list[dict]):
    """Train/validation loss, validation R2 and learning rate per epoch."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    epochs = [h["epoch"] for h in history]
    ax = axes[0]
    ax.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    ax.plot(epochs, [h["val_loss"] for h in history], "o-", label="validation")
    ax.set(xlabel="epoch", ylabel="Huber loss (standardised)", title="Loss")
    ax.legend()
    axes[1].plot(epochs, [h["r2"] for h in history], "o-", color="tab:green")
    axes[1].set(xlabel="epoch", ylabel="R2", title="Validation R2 (quick subset)")
    axes[2].plot(epochs, [h["lr"] for h in history], "o-", color="tab:gray")
    axes[2].set(xlabel="epoch", ylabel="learning rate", title="Learning rate (end of epoch)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def scatter_figure(true_km: np.ndarray, pred_km: np.ndarray, flights: np.ndarray, title: str = ""):
    fig, ax = plt.subplots(figsize=(5, 5))
    for name in dict.fromkeys(flights):
        m = flights == name
        ax.scatter(true_km[m], pred_km[m], s=12, alpha=0.7, label=str(name))
    lo = float(min(true_km.min(), pred_km.min()))
    hi = float(max(true_km.max(), pred_km.max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="perfect")
    ax.set(xlabel="true cloud base height (km)", ylabel="predicted (km)", title=title or "Predicted vs true")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class LiveCurves:
    """One figure redrawn in place in a notebook (display handle), closed after each update."""

    def __init__(self):
        from IPython.display import display
        self._handle = display("Curves appear after the first epoch.", display_id=True)
        self._shown = 0

    def update(self, history: list[dict]) -> None:
        if len(history) == self._shown or not history:
            return
        fig = curves_figure(history)
        self._handle.update(fig)
        plt.close(fig)
        self._shown = len(history)
