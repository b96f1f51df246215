"""Checkpoint retention: which of a model's checkpoints stay on disk.

A session with ``checkpoint_dir`` writes every model's state at every epoch end.
With ``keep_checkpoints=k`` it keeps, of each model, the ``k`` newest epochs and,
with ``keep_best=(metric, mode)``, the epoch whose reported ``metric`` is best
(the earliest of equals; NaN never is). It also keeps the newest checkpoint of an
epoch the model has reported: an epoch is checkpointed before it is evaluated, and
a resume continues after the furthest reported epoch it finds a checkpoint of, so
with ``k=1`` the epoch before the newest stays until the newest is reported.

The rest is removed as the search goes, by the checkpoint writer, right after it
wrote a newer checkpoint of the model (renamed into place and its folder synced)
and after each report: the newest valid checkpoint is never the one removed. A
removal takes the record (``.json``) first, so one cut short leaves no half
checkpoint; the next removal of that model finishes it.

Epochs newer than the one just written (left by an earlier run that got further)
are left alone: the model writes them again as it gets there.

Example:
    >>> Retention(2, ("val_loss", "min")).to_keep({1: 0.5, 2: 0.7, 3: 0.9, 4: 0.8}, written=4)
    [1, 3, 4]
    >>> Retention.of(0, None, "ckpt")
    Traceback (most recent call last):
    ValueError: keep_checkpoints is 0, but must be an int >= 1 (each model's newest checkpoints to keep) or None (all)
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from .checkpoint import checkpoint_epochs, orphan_states, remove_checkpoint, sync_folder

__all__ = ["Retention"]

logger = logging.getLogger("cerebro_automl")

_MODES = ("min", "max")


@dataclass(frozen=True)
class Retention:
    """Keep each model's ``last`` newest checkpoints and, with ``best`` =
    ``(metric, mode)``, its best epoch by that metric."""

    last: int
    best: tuple[str, str] | None = None

    @classmethod
    def of(
        cls,
        keep_checkpoints: Any,
        keep_best: Any,
        checkpoint_dir: str | os.PathLike | None,
        spec: Any = None,
        data: Any = None,
    ) -> Retention | None:
        """The Session's ``keep_checkpoints`` and ``keep_best``, checked (ValueError
        naming the value and the rule; the metric against what ``spec`` reports on
        ``data``, when it knows before training); None: every checkpoint is kept."""
        if keep_checkpoints is None:
            if keep_best is not None:
                raise ValueError(
                    f"keep_best is {keep_best!r}, but keep_checkpoints is None, which keeps every "
                    "checkpoint: pass keep_checkpoints=k to keep the k newest of each model and its best"
                )
            return None
        if isinstance(keep_checkpoints, bool) or not isinstance(keep_checkpoints, int) or keep_checkpoints < 1:
            raise ValueError(
                f"keep_checkpoints is {keep_checkpoints!r}, but must be an int >= 1 (each model's "
                "newest checkpoints to keep) or None (all)"
            )
        if checkpoint_dir is None:
            raise ValueError(
                f"keep_checkpoints is {keep_checkpoints!r}, but there is no checkpoint_dir: it says "
                "how many of the checkpoints written there to keep"
            )
        if keep_best is None:
            return cls(keep_checkpoints)
        if not (
            isinstance(keep_best, (tuple, list))
            and len(keep_best) == 2
            and isinstance(keep_best[0], str)
            and keep_best[0]
            and keep_best[1] in _MODES
        ):
            raise ValueError(
                f"keep_best is {keep_best!r}, but must be (metric, mode) with a metric's name "
                "and mode 'min' or 'max', such as ('val_loss', 'min'), or None"
            )
        metric, mode = keep_best
        metric_names = getattr(spec, "metric_names", None)  # None: learnt while training (Lightning)
        if metric_names is not None and getattr(data, "has_validation", None) is False:
            metric_names = [n for n in metric_names if not n.startswith("val_")]
        if metric_names is not None and metric not in metric_names:
            raise ValueError(f"keep_best is {tuple(keep_best)!r}, but the spec's epochs report {list(metric_names)}")
        return cls(keep_checkpoints, (metric, mode))

    @property
    def metric(self) -> str | None:
        return None if self.best is None else self.best[0]

    def to_keep(self, values: Mapping[int, float | None], written: int, reported: int | None = None) -> list[int]:
        """Of the epochs on disk up to ``written`` (each with its metric's value, or
        None), those to keep: the ``last`` newest, ``written`` among them, the newest
        up to ``reported`` (the model's newest reported epoch), and the best."""
        epochs = sorted(e for e in values if e <= written)
        keep = set(epochs[-self.last :]) | {written}
        if reported is not None:
            keep.update([e for e in epochs if e <= reported][-1:])
        if self.best is not None:
            sign = 1.0 if self.best[1] == "min" else -1.0
            scored = [(sign * v, e) for e, v in values.items() if e <= written and _finite(v)]
            if scored:
                keep.add(min(scored)[1])  # the best value; of equals, the earliest epoch
        return sorted(keep)

    def prune(self, directory: str | os.PathLike, key: str, written: int, reported: int | None = None) -> list[int]:
        """Remove the checkpoints of ``key`` that :meth:`to_keep` does not keep, now that
        the one after ``written`` epochs is on disk (and the model reported epochs up to
        ``reported``); return the epochs removed. Epochs after ``written`` are left
        alone. Not raising: a file that cannot be removed stays, with a warning."""
        try:
            sync_folder(directory, key)  # the new checkpoint's renames are durable first
            epochs = checkpoint_epochs(directory, key)
            values = {e: self._value(directory, key, e) for e in epochs if e <= written}
            keep = set(self.to_keep(values, written, reported))
            gone = [e for e in values if e not in keep]
            half = [e for e in orphan_states(directory, key) if e < written]
        except OSError as err:
            logger.warning(
                "checkpoints of %s in %s: retention skipped (%s: %s)", key, directory, type(err).__name__, err
            )
            return []
        removed = []
        for epoch in gone + half:
            try:
                remove_checkpoint(directory, key, epoch)
            except OSError as err:
                logger.warning(
                    "checkpoint of %s after epoch %d in %s could not be removed (%s: %s); it stays",
                    key,
                    epoch,
                    directory,
                    type(err).__name__,
                    err,
                )
                continue
            removed.append(epoch)
        if removed:
            logger.debug("checkpoints of %s after epochs %s removed (keeping %s)", key, removed, sorted(keep))
        return removed

    def _value(self, directory: str | os.PathLike, key: str, epoch: int) -> float | None:
        """The metric recorded in the checkpoint's record, or None (none asked, not
        reported yet, or the record unreadable)."""
        metric = self.metric
        if metric is None:
            return None
        try:
            record = json.loads((Path(directory) / key / f"epoch-{epoch}.json").read_text())
        except (OSError, ValueError):
            return None
        value = (record.get("metrics") or {}).get(metric)
        return float(value) if _finite(value) else None


def _finite(value: Any) -> TypeGuard[float]:
    """A number, not a bool, neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
