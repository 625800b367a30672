"""Learning-curve figures of training runs (matplotlib, Agg canvas, no pyplot state), and writing a figure as a PNG
atomically. Layer 0 (``dartree.base``: imports nothing of dartree but :mod:`~dartree.base.files`): the trainer draws
a run's curve with it and the report (``dartree-report --curves``) draws several, so neither imports the other.

A curve is the list of points the trainer (``training/train.py``) writes to ``<output_dir>/curve.json`` (and
checkpoints keep as ``learning_curve.json``): each point has ``train_tokens`` (training tokens seen), ``holdout_chain_tau`` and
``holdout_tf_tau`` (held-out chain and teacher-forced acceptance length) and, where recorded, ``train_loss`` (the
mean training loss since the previous point).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from dartree.base.files import write_file_atomically


def save_png(fig: Figure, path: str | Path, dpi: int = 110) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically under a unique temporary name; returns the path."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    write_file_atomically(Path(path), buf.getvalue())
    return Path(path)


def fig_curves(curves: dict[str, list[dict]]) -> Figure:
    """Learning curves: held-out chain tau (solid, ``gid`` = label) and held-out teacher-forced tau (dotted,
    ``gid`` = label + ``:tf``) against training tokens seen; a second panel with the training loss (``gid`` =
    label + ``:loss``, the mean over the steps since the previous point) when any curve records ``train_loss``.

    Args:
        curves: ``{label: curve.json points}``; each point has ``train_tokens`` and ``holdout_chain_tau``.
    Raises:
        ValueError: no curve has a point.
    """
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        raise ValueError("no learning-curve points to plot")
    has_loss = any("train_loss" in p for v in curves.values() for p in v)
    fig = Figure(figsize=(10.0 if has_loss else 6.0, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if has_loss else 1, squeeze=False)[0]
    cmap = matplotlib.colormaps["tab10"]
    for i, (label, pts) in enumerate(curves.items()):
        c = cmap(i % 10)
        x = [p["train_tokens"] for p in pts]
        axes[0].plot(x, [p["holdout_chain_tau"] for p in pts], marker="o", ms=3, color=c, gid=label,
                     label=f"{label} (end {pts[-1]['holdout_chain_tau']:.3f})")
        if all("holdout_tf_tau" in p for p in pts):
            axes[0].plot(x, [p["holdout_tf_tau"] for p in pts], ls=":", color=c, gid=f"{label}:tf")
        if has_loss:
            lp = [p for p in pts if "train_loss" in p]
            if lp:
                axes[1].plot([p["train_tokens"] for p in lp], [p["train_loss"] for p in lp], marker="o", ms=3,
                             color=c, gid=f"{label}:loss", label=label)
    axes[0].set_ylabel("held-out tau")
    axes[0].set_title("Held-out chain tau (dotted: teacher-forced)", fontsize=10)
    extra = [Line2D([], [], color="0.3", label="chain"), Line2D([], [], color="0.3", ls=":", label="teacher-forced")]
    h, _ = axes[0].get_legend_handles_labels()
    axes[0].legend(handles=h + extra, fontsize=7)
    if has_loss:
        axes[1].set_ylabel("training loss")
        axes[1].set_title("Training loss (mean since the previous point)", fontsize=10)
        axes[1].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("training tokens seen")
        ax.grid(alpha=0.3)
    return fig


def plot_curve_file(curve: list[dict], png: str | Path, label: str = "run") -> Path | None:
    """Write the learning-curve picture of one run (held-out tau and training loss against tokens seen) to
    ``png``; for training: a plotting problem is printed as a warning and returns None, never raises."""
    try:
        return save_png(fig_curves({label: curve}), png)
    except Exception as exc:  # never fail training over a picture
        print(f"WARNING: learning-curve picture {png} not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
