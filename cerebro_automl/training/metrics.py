"""What an epoch reports: per-shard validation sums and how they combine, in
partition order, into the epoch's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["accuracy", "EvalResult", "epoch_metrics", "logged_means"]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Fraction of rows whose arg-max equals the target class (a batch mean).

    ``targets`` are class indices of shape ``outputs.shape[:-1]`` (a trailing
    dimension of 1 is dropped), or one-hot rows or class probabilities of the shape
    of ``outputs`` (their arg-max is the class).

    Example:
        >>> out = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
        >>> [round(float(accuracy(out, t)), 3) for t in (torch.tensor([1, 0, 0]), torch.tensor([[1], [0], [0]]))]
        [0.667, 0.667]
    """
    if outputs.dim() == 0 or outputs.shape[-1] < 2:
        raise ValueError(
            f"accuracy got outputs of shape {tuple(outputs.shape)}, but takes one score per class (2 or more in "
            "the last dimension); for one logit, write a metric of your own, e.g. ((outputs > 0) == targets)"
        )
    predicted = outputs.argmax(dim=-1)
    if targets.shape == outputs.shape and outputs.dim() > 1:
        targets = targets.argmax(dim=-1)
    elif targets.dim() == outputs.dim() and targets.shape[-1:] == (1,):
        targets = targets.squeeze(-1)
    if targets.shape != predicted.shape:
        raise ValueError(
            f"accuracy got outputs of shape {tuple(outputs.shape)} and targets of shape {tuple(targets.shape)}, "
            f"but targets must be class indices of shape {tuple(predicted.shape)} or rows of the outputs' shape"
        )
    return (predicted == targets).float().mean()


@dataclass(frozen=True)
class EvalResult:
    """One validation shard's sums, plus the training progress of the epoch
    (carried in the state, so the driver never fetches a state for metrics).
    The driver adds shards up in partition order."""

    loss_sum: float | None  # None: the spec computes no loss of its own (Lightning logs it)
    metric_sums: dict[str, float]
    samples: int
    seconds: float
    progress: dict[str, Any]
    logged: dict[str, list[float]] = field(default_factory=dict)  # name -> [weighted sum, weight]
    # A fusion group's shard: each member's result, and the members that failed (with why).
    members: dict[int, EvalResult] | None = None
    failed: dict[int, str] = field(default_factory=dict)


def epoch_metrics(results: list[EvalResult]) -> dict[str, Any]:
    """Combine per-shard results (in partition order) into the epoch's metrics.

    A fusion group's results give ``{"members": {model_id: metrics}, "failed":
    {model_id: reason}, "unfused": reason | None}``.

    >>> r = EvalResult(2.0, {"accuracy": 1.0}, 4, 0.1, {"loss_sum": 3.0, "samples": 6, "seconds": 1.0})
    >>> epoch_metrics([r, r])["val_loss"]
    0.5
    """
    if results[0].members is not None:
        return _group_metrics(results)
    progress = results[0].progress
    out: dict[str, Any] = {
        "train_loss": progress["loss_sum"] / max(progress["samples"], 1),
        "train_seconds": progress["seconds"],
    }
    out.update(logged_means([progress.get("logged", {})]))
    samples = sum(r.samples for r in results)
    if samples:
        if results[0].loss_sum is not None:
            out["val_loss"] = sum(r.loss_sum for r in results if r.loss_sum is not None) / samples
        for name in results[0].metric_sums:
            out[f"val_{name}"] = sum(r.metric_sums[name] for r in results) / samples
        out.update(logged_means([r.logged for r in results]))
    out["val_seconds"] = sum(r.seconds for r in results)
    return out


def _group_metrics(results: list[EvalResult]) -> dict[str, Any]:
    failed: dict[int, str] = {}
    for r in results:
        failed.update(r.failed)
    first = results[0].members or {}
    members = {
        mid: epoch_metrics([(r.members or {})[mid] for r in results])
        for mid in first
        if mid not in failed and all(mid in (r.members or {}) for r in results)
    }
    return {"members": members, "failed": failed, "unfused": results[0].progress.get("unfused")}


def logged_means(parts: list[dict[str, list[float]]]) -> dict[str, float]:
    """Combine ``name -> [weighted sum, weight]`` pieces into weighted means, names in first-seen order.

    >>> logged_means([{"acc": [3.0, 4]}, {"acc": [1.0, 4]}])
    {'acc': 0.5}
    """
    total: dict[str, list[float]] = {}
    for part in parts:
        for name, (value, weight) in part.items():
            acc = total.setdefault(name, [0.0, 0.0])
            acc[0] += value
            acc[1] += weight
    return {name: value / weight for name, (value, weight) in total.items() if weight}
