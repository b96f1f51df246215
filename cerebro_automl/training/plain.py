"""The hooks of a plain :class:`~cerebro_automl.training.TrainingSpec`: its
``optimizer_fn``, ``scheduler_fn``, ``forward_fn``, ``loss_fn`` and ``metrics``
in the one training loop and the validation pass."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from .loop import EvalHooks, TrainHooks
from .metrics import EvalResult
from .schedulers import SchedulerConfig, scheduler_config
from .transfer import to_floats

if TYPE_CHECKING:
    from .contract import RunSpec

__all__ = ["PlainTrainHooks", "PlainEvalHooks"]


_F = TypeVar("_F", bound=Callable[..., Any])


def _given(fn: _F | None) -> _F:
    """A function the plain hooks need; TrainingSpec refuses a spec without it that
    trains with them, so None here is a bug of this package."""
    if fn is None:
        raise AssertionError("the plain hooks need optimizer_fn and loss_fn")
    return fn


class PlainTrainHooks(TrainHooks):
    """``optimizer_fn`` and ``scheduler_fn`` build the optimizer and its scheduler (stepped
    once per model-epoch, or after every optimizer step when ``scheduler_fn`` returns
    ``{"scheduler": s, "interval": "step"}``); a batch's loss is
    ``loss_fn(*spec.forward(model, x, y))``."""

    def __init__(self, spec: RunSpec, config: Mapping[str, Any]) -> None:
        self.spec, self.config = spec, config
        self._forward, self._loss_fn = spec.forward, _given(spec.loss_fn)

    def configure(self, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
        optimizer = _given(self.spec.optimizer_fn)(self.config, model.parameters())
        if self.spec.scheduler_fn is None:
            return optimizer, []
        return optimizer, [scheduler_config(self.spec.scheduler_fn(self.config, optimizer))]

    def step_loss(self, model: torch.nn.Module, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = call_loss(self._loss_fn, *self._forward(model, *batch), batch[0])
        if loss is None:  # None would skip the step: a loss_fn that forgot to return
            raise TypeError("loss_fn returned None, but must return the batch's loss as a scalar tensor")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
            raise TypeError(
                f"loss_fn returned {what}, but must return the batch's loss as a one-element tensor computed "
                "from the outputs (its gradient trains the model): reduce it with .mean(), and do not call .item()"
            )
        return loss


class PlainEvalHooks(EvalHooks):
    """Sums ``loss_fn`` and each metric over the shard, each batch mean times its rows."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self._loss_fn = _given(spec.loss_fn)
        # Each batch's values stay on the device until the pass ends: one wait, not one per batch.
        self.values: list[Any] = []
        self.sizes: list[int] = []

    def step(self, model: torch.nn.Module, x: Any, y: Any, rows: int, batch_idx: int) -> None:
        out, targets = self.spec.forward(model, x, y)
        self.values.append(_batch_value(call_loss(self._loss_fn, out, targets, x), "loss_fn"))
        for name, fn in self.spec.metrics.items():
            self.values.append(_batch_value(fn(out, targets), f"metric {name!r}"))
        self.sizes.append(rows)

    def result(self) -> EvalResult:
        sums = dict.fromkeys(self.spec.metrics, 0.0)
        numbers = iter(to_floats(self.values))
        loss_sum = 0.0
        for n in self.sizes:  # each sum in batch order, as per-batch reads would add them
            loss_sum += next(numbers) * n
            for name in self.spec.metrics:
                sums[name] += next(numbers) * n
        return EvalResult(loss_sum, sums, sum(self.sizes), 0.0, {})

    def empty(self) -> EvalResult:
        return EvalResult(0.0, dict.fromkeys(self.spec.metrics, 0.0), 0, 0.0, {})


def call_loss(loss_fn: Any, outputs: Any, targets: Any, x: Any) -> Any:
    """``loss_fn(outputs, targets)``. When the outputs are not a tensor (a HuggingFace
    model's ``SequenceClassifierOutput``, say) and the loss fails on them, the error
    says that ``forward_fn`` maps a model's output to the loss's input: torch's own
    message names only the type it wanted.

    >>> call_loss(torch.nn.functional.cross_entropy, {"logits": torch.zeros(2, 3)},
    ...           torch.zeros(2, dtype=torch.long), {"input_ids": None})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: loss_fn(outputs, targets) failed on the model's output, a dict, not a tensor: ...
    """
    try:
        return loss_fn(outputs, targets)
    except (TypeError, AttributeError) as error:
        if isinstance(outputs, torch.Tensor):
            raise
        call = "model(**x)" if isinstance(x, Mapping) else "model(*x)" if isinstance(x, tuple) else "model(x)"
        raise TypeError(
            f"loss_fn(outputs, targets) failed on the model's output, a {type(outputs).__name__}, not a "
            "tensor: TrainingSpec(forward_fn=...) maps a model's output to the loss's input, e.g. "
            f"forward_fn=lambda model, x, y: ({call}.logits, y) ({error})"
        ) from error


def _batch_value(value: Any, source: str) -> Any:
    """``value`` itself when it is one number for the batch: a one-element real tensor
    or a real number (its read waits for the pass's end); otherwise a TypeError names
    ``source`` and the rule. A string would be read as a number, and None or a vector
    would fail later naming nothing.

    >>> _batch_value(torch.zeros(3), "metric 'acc'")  # doctest: +NORMALIZE_WHITESPACE
    Traceback (most recent call last):
    TypeError: metric 'acc' returned a tensor of shape (3,) for a validation batch, but must return a scalar
    per batch: the batch mean, as a one-element tensor or a number
    """
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex():
            return value
        what = f"a tensor of shape {tuple(value.shape)}" if value.numel() != 1 else f"a {value.dtype} tensor"
    elif isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        return value
    else:
        what = f"{type(value).__name__} {value!r}"[:120]
    raise TypeError(
        f"{source} returned {what} for a validation batch, but must return a scalar per "
        "batch: the batch mean, as a one-element tensor or a number"
    )
