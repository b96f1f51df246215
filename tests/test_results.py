"""plot_learning_curves: a figure per history, saved as a PNG."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from cerebro_automl import Session  # noqa: E402
from cerebro_automl.results import plot_learning_curves  # noqa: E402

from models import CONFIGS  # noqa: E402


def test_plot_learning_curves_draws_every_model_and_saves_a_png(spec, data, tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    with Session(spec, data, executor="local") as s:
        for c in CONFIGS:
            s.add(c, epochs=3)
        history = s.run()
    fig = plot_learning_curves(history, "val_accuracy", mode="max", path=tmp_path / "curves.png")
    ax = fig.axes[0]
    assert len(ax.lines) == len(CONFIGS)
    best = history[history.epoch == 3].sort_values("val_accuracy", ascending=False).iloc[0]
    assert ax.lines[0].get_label().startswith(f"#{best.model_id} ") and ax.lines[0].get_label().endswith("(best)")
    assert list(ax.lines[0].get_xdata()) == [1, 2, 3]
    assert all(float(t).is_integer() for t in ax.get_xticks())  # no epoch 1.5
    assert ax.get_title() == f"val_accuracy per epoch ({len(CONFIGS)} of the {len(CONFIGS)} models with a val_accuracy)"
    assert (tmp_path / "curves.png").stat().st_size > 5000
    assert len(plot_learning_curves(history, "val_loss", top=2).axes[0].lines) == 2
    with pytest.raises(ValueError, match=r"history lacks the columns \['val_f1'\]"):
        plot_learning_curves(history, "val_f1")
    renamed = history.assign(name=[f"trial-{8 + m}" for m in history.model_id])  # an Optuna call's, ids from 0
    assert plot_learning_curves(renamed, "val_accuracy", mode="max").axes[0].lines[0].get_label().startswith(
        f"trial-{8 + best.model_id} ")
    with pytest.raises(ValueError, match=r"top is 0, but must be an int >= 1 or None"):
        plot_learning_curves(history, "val_loss", top=0)
    with pytest.raises(ValueError, match=r"mode is 'best', but must be 'min' or 'max'"):
        plot_learning_curves(history, "val_loss", mode="best")
    matplotlib.pyplot.close("all")
