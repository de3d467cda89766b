"""Training curves and predicted-vs-true scatter, as PNG files and for live notebook display."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Figures are built as plain Figure objects, never through pyplot: the notebook's inline backend
# shows every pyplot figure still open when a cell ends, so an interrupt between creating and
# closing one would show the curves twice. A plain Figure saves through matplotlib's Agg canvas
# whatever the backend is, so nothing here chooses one (asking matplotlib for its backend imports
# pyplot). matplotlib itself is imported where a figure is made: about half a second of every
# command's start, in the many processes (a sweep's trials, torchrun's) that draw nothing.


R2_FLOOR = -1.0  # the R2 axis stops here: a tiny quick subset's R2 of -40 would flatten every other value


def curves_figure(history: list[dict]) -> Figure:
    """Train/validation loss, validation R2 and learning rate per epoch (validation: the training flights'
    validation data, which chose the model; the chosen epoch, the lowest validation loss, ringed). Every
    marker inside its axes (a margin above the highest), the loss legend above the axes (never over a line),
    R2 drawn from -1 to 1 with a note when a value lies below."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 3.9))
    axes = fig.subplots(1, 3)
    epochs = [h["epoch"] for h in history]
    ax = axes[0]
    ax.plot(epochs, [h["train_loss"] for h in history], "o-", label="train")
    ax.plot(epochs, [h["val_loss"] for h in history], "o-", label="validation")
    losses = [h["val_loss"] if h.get("val_loss") is not None else np.inf for h in history]
    best = int(np.argmin(losses)) if np.isfinite(min(losses)) else None
    if best is not None:
        ax.plot(epochs[best], losses[best], "o", ms=12, mfc="none", color="k", label="chosen")
    ax.set(xlabel="epoch", ylabel="Huber loss (standardised)")
    ax.set_title("Loss", loc="left")
    ax.legend(
        loc="lower right",
        bbox_to_anchor=(1.0, 1.0),
        ncol=3,
        frameon=False,
        borderaxespad=0.2,
        fontsize=8,
        columnspacing=0.8,
        handlelength=1.5,
    )
    _plot_r2(axes[1], epochs, [h["r2"] for h in history])
    if best is not None and history[best].get("r2") is not None:
        axes[1].plot(epochs[best], max(history[best]["r2"], R2_FLOOR), "o", ms=12, mfc="none", color="k")
    axes[2].plot(epochs, [h["lr"] for h in history], "o-", color="tab:gray")
    axes[2].set(xlabel="epoch", ylabel="learning rate")
    axes[2].set_title("Learning rate (end of epoch)", loc="left")
    # Anchored axes: a first epoch's single value is read against 0 (and R2 against 1), not a +-4% zoom;
    # 8% above the highest value, so that its marker is not cut by the frame.
    for a, keys in ((axes[0], ("train_loss", "val_loss")), (axes[2], ("lr",))):
        values = [h[k] for h in history for k in keys if h.get(k) is not None and np.isfinite(h[k])]
        a.set_ylim(0, 1.08 * max(values) if values and max(values) > 0 else 1.0)
    for a in axes:
        a.grid(alpha=0.3)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.set_xlim(0.5, max(max(epochs), 2) + 0.5)  # one epoch is a point, not a whole axis
    fig.tight_layout()
    return fig


def _plot_r2(ax, epochs: list[int], r2: list) -> None:
    """Validation R2 between -1 and 1 (a value below -1 drawn at -1, said in a note: the quick subset is a
    few hundred samples, and one bad epoch on it says little); markers at 1 stay whole (not clipped)."""
    values = [np.nan if v is None else float(v) for v in r2]
    ax.plot(epochs, np.maximum(values, R2_FLOOR), "o-", color="tab:green", clip_on=False)
    ax.set(xlabel="epoch", ylabel="R2")
    ax.set_title("Validation R2 (training flights' validation data)", loc="left")
    finite = [v for v in values if np.isfinite(v)]
    ax.set_ylim(max(R2_FLOOR, min([0.0] + finite)) - 0.05, 1.0)
    if finite and min(finite) < R2_FLOOR:  # under the axis, where it covers no marker
        ax.set_xlabel(f"epoch\nlowest R2 {min(finite):.3g}, drawn at {R2_FLOOR:g} (a small subset)")


def scatter_figure(true_km: np.ndarray, pred_km: np.ndarray, flights: np.ndarray, title: str = "") -> Figure:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    for name in dict.fromkeys(flights):
        m = flights == name
        ax.scatter(true_km[m], pred_km[m], s=12, alpha=0.7, label=str(name))
    if not true_km.size:  # test flights of high cloud alone, say: scored for their cloud flag
        ax.text(
            0.5, 0.5, "no height label on the test flights", ha="center", va="center", transform=ax.transAxes
        )
        ax.set(title=title or "Predicted vs true")
        return fig
    lo = float(min(true_km.min(), pred_km.min()))
    hi = float(max(true_km.max(), pred_km.max()))
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="perfect")
    ax.set(xlabel="true cloud base height (km)", ylabel="predicted (km)", title=title or "Predicted vs true")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path: str | Path) -> Path:
    from cloudml_lib.base.outputs import atomic_path

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


def image_pixels(png: str | Path) -> np.ndarray | None:
    """A PNG the run wrote (the evaluation scatter) as TensorBoard shows it: height x width x RGB, floats in
    0..1; None where it is not there."""
    import matplotlib.image

    if not Path(png).is_file():
        return None
    return matplotlib.image.imread(str(png))[..., :3]
