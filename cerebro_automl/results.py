"""Looking at a history: learning curves with matplotlib (the ``examples`` extra).

Example:
    >>> from cerebro_automl.results import plot_learning_curves
    >>> fig = plot_learning_curves(session.history, "val_accuracy", mode="max",
    ...                            path="curves.png")                    # doctest: +SKIP
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from .values import rank_key

__all__ = ["plot_learning_curves"]


def plot_learning_curves(
    history: pd.DataFrame,
    metric: str,
    *,
    mode: str = "min",
    label: Callable[[pd.Series], str] | None = None,
    top: int | None = 10,
    ax: Any = None,
    path: str | Path | None = None,
    title: str | None = None,
) -> Any:
    """Plot ``metric`` per epoch for each model of ``history``; return the figure.

    Args:
        history: a session's (or a tuner result's) history: one row per model-epoch
            with ``model_id``, ``epoch`` and ``metric``.
        metric: the column to plot, e.g. ``"val_accuracy"``.
        mode: ``"min"`` or ``"max"``: which end is best. The best model's curve is
            drawn thick; the others thin.
        label: ``row -> legend label`` from a model's first row (default: its id and config).
        top: draw only the ``top`` best models by their last value (None: all).
        ax: a matplotlib Axes to draw into (default: a new figure).
        path: also save the figure there (PNG by the suffix).
    """
    try:
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:  # pragma: no cover - part of the examples extra
        raise ImportError("plot_learning_curves needs matplotlib: pip install 'cerebro-automl[examples]'") from None
    if mode not in ("min", "max"):
        raise ValueError(f"mode is {mode!r}, but must be 'min' or 'max'")
    if top is not None and (isinstance(top, bool) or not isinstance(top, numbers.Integral) or top < 1):
        raise ValueError(f"top is {top!r}, but must be an int >= 1 or None (all models)")
    missing = {"model_id", "epoch", metric} - set(history.columns)
    if missing:
        raise ValueError(f"history lacks the columns {sorted(missing)}; it has {list(history.columns)}")
    rows = history.dropna(subset=[metric]).sort_values(["model_id", "epoch"])
    if rows.empty:
        raise ValueError(f"history has no values of {metric!r} to plot")
    last = rows.groupby("model_id")[metric].last()
    ranked = sorted(last.index, key=lambda m: (rank_key(last[m], mode), m))
    shown = ranked[:top] if top is not None else ranked
    label = label or _default_label
    fig, ax = plt.subplots(figsize=(7, 4.5)) if ax is None else (ax.figure, ax)
    for rank, model_id in enumerate(shown):
        curve = rows[rows["model_id"] == model_id]
        ax.plot(
            curve["epoch"],
            curve[metric],
            marker="o",
            markersize=3,
            linewidth=2.5 if rank == 0 else 1.0,
            alpha=1.0 if rank == 0 else 0.6,
            label=label(curve.iloc[0]) + (" (best)" if rank == 0 else ""),
        )
    ax.set_xlabel("epoch")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    ax.set_ylabel(metric)
    ax.set_title(title or f"{metric} per epoch ({len(shown)} of the {len(ranked)} models with a {metric})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def _default_label(row: pd.Series) -> str:
    """``#<model id>`` and the config; a model named otherwise than ``model-<id>`` (an
    Optuna trial's ``trial-<n>``, whose id restarts with each call) by its name."""
    config = row.get("config")
    text = ", ".join(f"{k}={_short(v)}" for k, v in config.items()) if isinstance(config, dict) else ""
    name = row.get("name")
    head = name if isinstance(name, str) and name != f"model-{row['model_id']}" else f"#{row['model_id']}"
    return f"{head} {text}".strip()


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
