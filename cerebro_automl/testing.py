"""The conformance suite every tuner adapter passes.

A tuner drives a :class:`~cerebro_automl.Session`: it adds models, reads their
reports, stops, extends and forks them. :func:`check_tuner` runs a tuner twice
on a tiny real problem (:func:`conformance_problem`: real torch training, on the
in-process executor, a second or so) and checks what every tuner owes its user:

* report order: each model reports its epochs one by one, in order, from the
  epoch it started at (a fork: after its parent's epoch), across pauses and
  extensions;
* stop: nothing is reported for a model after it was stopped or failed;
* failure handling: the configurations that fail (``model_fn`` raises for them)
  fail alone, with the reason in the history; the tuner ends normally and never
  names a failed model the best;
* no leaked sessions: every session the tuner started has ended;
* reproducibility: a second run gives the same history, bit for bit.

A new tuner adapter adds one entry to ``tests/test_conformance.py``.

Example:
    >>> from cerebro_automl.testing import check_tuner, conformance_problem
    >>> from cerebro_automl.adapters.search import grid_search
    >>> from cerebro_automl.testing import FAIL_WIDTH
    >>> spec, data = conformance_problem()
    >>> check_tuner(lambda **kw: grid_search(spec, data, {"lr": [0.01, 0.1], "width": [4, FAIL_WIDTH]},
    ...                                     epochs=2, **kw))   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from .callbacks import Callback
from .data import PartitionedDataset
from .training import TrainingSpec, accuracy

__all__ = ["FAIL_WIDTH", "conformance_problem", "check_tuner", "EventLog"]

FAIL_WIDTH = 13  # a config with this width fails: model_fn raises in its first unit


def _model(config: Any) -> nn.Module:
    if config["width"] == FAIL_WIDTH:
        raise RuntimeError(f"width {FAIL_WIDTH} is the conformance suite's failing configuration")
    return nn.Sequential(
        nn.Linear(4, config["width"]), nn.ReLU(), nn.Dropout(config.get("dropout", 0.0)), nn.Linear(config["width"], 2)
    )


def _optimizer(config: Any, params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=config["lr"], momentum=0.5)


def conformance_problem(rows: int = 240) -> tuple[TrainingSpec, PartitionedDataset]:
    """A tiny real problem: 4 features, 2 classes, 3 partitions with validation data.
    Configs take ``lr``, ``width`` (``FAIL_WIDTH`` fails) and optionally ``dropout``."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] > 0).astype(np.int64)
    spec = TrainingSpec(
        model_fn=_model,
        optimizer_fn=_optimizer,
        loss_fn=nn.functional.cross_entropy,
        metrics={"accuracy": accuracy},
        batch_size=16,
    )
    return spec, PartitionedDataset.from_arrays(X, y, num_partitions=3, valid_fraction=0.25)


class EventLog(Callback):
    """Records, in order, what every session it is given did: ``(kind, session, model, epoch)``,
    and each session's history when it ends (sessions told apart by their views)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int | None, int | None]] = []
        self.sessions: list[Any] = []
        self.histories: list[pd.DataFrame] = []

    def _log(self, kind: str, view: Any, model_id: int | None = None, epoch: int | None = None) -> None:
        if not any(s is view for s in self.sessions):
            self.sessions.append(view)
        index = next(i for i, s in enumerate(self.sessions) if s is view)
        self.events.append((kind, index, model_id, epoch))

    def on_session_start(self, view: Any) -> None:
        self._log("start", view)

    def on_model_added(self, view: Any, model_id: int) -> None:
        self._log("added", view, model_id)

    def on_epoch_end(self, view: Any, report: Any) -> None:
        self._log("epoch", view, report.model_id, report.epoch)

    def on_model_paused(self, view: Any, report: Any) -> None:
        self._log("paused", view, report.model_id, report.epochs)

    def on_model_stopped(self, view: Any, model_id: int) -> None:
        self._log("stopped", view, model_id)

    def on_model_failed(self, view: Any, report: Any) -> None:
        self._log("failed", view, report.model_id)

    def on_session_end(self, view: Any) -> None:
        self._log("end", view)
        self.histories.append(view.history)


def check_tuner(run: Callable[..., Any], *, expect_failures: bool = True) -> Any:
    """Run ``run(executor="local", session_callbacks=[log])`` twice and check the
    tuner's contract (see the module docstring); return the first run's result.

    The histories are taken from the sessions themselves, so ``run`` may return
    whatever the tuner returns; a ``best_model_id`` on it is checked too. Raises
    AssertionError naming the broken rule.
    """
    first_log, second_log = EventLog(), EventLog()
    first = run(executor="local", session_callbacks=[first_log])
    run(executor="local", session_callbacks=[second_log])
    _check_sessions(first_log)
    if not first_log.histories:
        raise AssertionError("the tuner started no session with the session_callbacks it was given")
    history = first_log.histories[-1]
    _check_reports(first_log, history)
    _check_failures(first, history, expect_failures)
    if len(first_log.histories) != len(second_log.histories):
        raise AssertionError("a second run with the same seed started another number of sessions")
    for a, b in zip(first_log.histories, second_log.histories, strict=True):
        _check_same(a, b)
    return first


def _check_sessions(log: EventLog) -> None:
    for index in range(len(log.sessions)):
        kinds = [k for k, s, _, _ in log.events if s == index and k in ("start", "end")]
        if kinds != ["start", "end"]:
            raise AssertionError(
                f"session {index} started and ended {kinds}: a tuner must close every session it starts, once"
            )
        if not log.sessions[index].closed:
            raise AssertionError(f"session {index} is still open after the tuner returned")


def _check_reports(log: EventLog, history: pd.DataFrame) -> None:
    """Epochs arrive one by one, in order (an extended model's next epoch follows on);
    nothing after a stop or failure."""
    next_epoch: dict[tuple[int, int], int] = {}
    ended: set[tuple[int, int]] = set()
    starts = {}
    if "parent_epoch" in history:
        starts = {m: int(e) + 1 for m, e in history.groupby("model_id")["parent_epoch"].first().items() if pd.notna(e)}
    for kind, session, model, epoch in log.events:
        if model is None:
            continue  # a session's start or end
        key = (session, model)
        if kind == "added":
            next_epoch[key] = starts.get(model, 1)
        elif kind == "epoch":
            if key in ended:
                raise AssertionError(f"model {model} reported epoch {epoch} after it was stopped or failed")
            if epoch is None or epoch != next_epoch.get(key):
                raise AssertionError(
                    f"model {model} reported epoch {epoch}, but its next epoch is "
                    f"{next_epoch.get(key)}: reports must come one by one, in order"
                )
            next_epoch[key] = epoch + 1
        elif kind in ("stopped", "failed"):
            ended.add(key)


def _check_failures(result: Any, history: pd.DataFrame, expect: bool) -> None:
    failing = history["config"].map(lambda c: c.get("width") == FAIL_WIDTH)
    failed = set(history.loc[history["error"].notna(), "model_id"]) if "error" in history else set()
    should = set(history.loc[failing, "model_id"])
    if expect and not should:
        raise AssertionError(
            f"the tuner trained no configuration with width {FAIL_WIDTH}; give it one, or pass expect_failures=False"
        )
    if failed != should:
        raise AssertionError(
            f"models {sorted(failed)} failed, but exactly those with width {FAIL_WIDTH} "
            f"({sorted(should)}) should have, each alone"
        )
    best = getattr(result, "best_model_id", None)
    if best is not None and best in failed:
        raise AssertionError(f"the tuner names model {best}, which failed, the best")


def _check_same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """The same rows, metrics bit for bit (timings aside)."""
    keep = [c for c in a.columns if not c.endswith("seconds") and c not in ("error",)]
    if list(a.columns) != list(b.columns):
        raise AssertionError(
            f"a second run with the same seed gave another history: its columns are "
            f"{list(b.columns)}, the first run's {list(a.columns)}"
        )
    order = ["model_id", "epoch"]
    a, b = (h.sort_values(order, kind="stable").reset_index(drop=True)[keep] for h in (a, b))
    try:
        pd.testing.assert_frame_equal(a, b, check_exact=True)
    except AssertionError as err:
        raise AssertionError(f"a second run with the same seed gave another history: {err}") from None
