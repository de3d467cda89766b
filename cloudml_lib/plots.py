"""Training curves and predicted-vs-true scatter, as PNG files and for live notebook display."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline", "inline"):
    matplotlib.use("Agg")  # headless by default; notebooks keep their own backend
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

# Figures are built as plain Figure objects, never through pyplot: the notebook's inline backend
# shows every pyplot figure still open when a cell ends, so an interrupt between creating and
# closing one would show the curves twice.


def curves_figure(history: list[dict]) -> Figure:
    """Train/validation loss, validation R2 and learning rate per epoch."""
    fig = Figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
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
    # Anchored axes: a first epoch's single value is read against 0 (and R2 against 1), not a +-4% zoom.
    axes[0].set_ylim(bottom=0)
    r2 = [h["r2"] for h in history if h["r2"] is not None and np.isfinite(h["r2"])]
    axes[1].set_ylim(min([0.0] + r2) - 0.05, 1.0)
    axes[2].set_ylim(bottom=0)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0.5, max(max(epochs), 2) + 0.5)  # one epoch is a point, not a whole axis
    fig.tight_layout()
    return fig


def scatter_figure(true_km: np.ndarray, pred_km: np.ndarray, flights: np.ndarray, title: str = "") -> Figure:
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
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


def save_figure(fig: Figure, path: str | Path) -> Path:
    from cloudml_lib.outputs import atomic_path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format=path.suffix.lstrip(".") or "png")
    return path


def curves_png(history: list[dict], dpi: int = 90) -> bytes:
    """The curves as PNG bytes, for a notebook widget (a Figure made without pyplot has no notebook
    formatter and would show as text)."""
    buf = io.BytesIO()
    curves_figure(history).savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()
