"""PyTorch Lightning modules on MOP, unmodified: ``LightningSpec(module_fn)``.

``module_fn(config)`` returns a ``LightningModule`` (from ``lightning.pytorch``
or ``pytorch_lightning``). The result is a :class:`~cerebro_automl.TrainingSpec`
that every tuner accepts. Each unit trains in the library's one training loop
(:mod:`cerebro_automl.training.loop`), whose hooks this adapter fills with the
module's own, the way Lightning's automatic optimization calls them, without a
``Trainer``: ``benchmarks/bench_lightning.py`` measures a Trainer per unit at
several times the overhead budget, and this at a few percent of a plain-PyTorch
unit. Errors (a non-finite loss raises ``NonFiniteLossError``) and the saved
state's form are the loop's, as for a plain TrainingSpec.

Example:
    >>> from cerebro_automl.adapters.lightning import LightningSpec
    >>> spec = LightningSpec(lambda config: LitClassifier(lr=config["lr"]), batch_size=64)
    >>> grid_search(spec, data, {"lr": [1e-3, 1e-2]}, epochs=5, metric="val_acc", mode="max")  # doctest: +SKIP

What a unit does (train one pass over one partition):

* ``configure_optimizers()`` in any return form: an optimizer, a list of one,
  ``([optimizers], [schedulers])``, or a dict with ``"optimizer"`` and
  ``"lr_scheduler"`` (a scheduler or a dict with ``interval`` "epoch" or
  "step", ``frequency`` and ``monitor``). Optimizer and scheduler states hop
  with the weights. Several optimizers need manual optimization in Lightning 2,
  and ``automatic_optimization = False`` is refused: in manual optimization the
  loop lives in ``training_step`` and needs a Trainer's strategy.
* per batch: ``on_train_batch_start``, ``training_step(batch, batch_idx)`` (a
  loss tensor or a dict with ``"loss"``; ``None`` skips the batch),
  ``on_before_zero_grad``, ``zero_grad``, ``on_before_backward``, backward,
  ``on_after_backward``, ``on_before_optimizer_step``, ``optimizer.step()``,
  "step" schedulers, ``on_train_batch_end``.
* ``on_train_epoch_start`` runs in the first unit of each model-epoch and
  ``on_train_epoch_end`` in the last, then the "epoch" schedulers step: once
  per model-epoch, whichever workers the epoch's units ran on.
* ``self.current_epoch`` and ``self.global_step`` are the model's own epoch and
  optimizer step, and ``batch_idx`` counts batches across the whole epoch, as
  they hop. Module attributes other than the ``state_dict`` do not hop.
* ``self.log`` / ``self.log_dict`` values are collected as weighted means
  (``reduce_fx="mean"``, the default; weights are the batch sizes):
  validation values are summed over all validation shards, so they equal the
  value on the full validation set, and appear under their own names in the
  epoch reports and the history; training values appear as epoch means.

Validation runs ``validation_step(batch, batch_idx)`` under ``torch.no_grad()``
on every validation shard. Not called: ``setup``, ``prepare_data``, the
``*_dataloader`` hooks (data comes from the PartitionedDataset), ``on_fit_*``,
``on_train_start/end``, the validation epoch hooks (they would run once per
shard), checkpoint hooks and ``optimizer_step`` overrides. A ReduceLROnPlateau
``monitor`` must name a value logged in ``training_step``: under MOP an
epoch's validation runs after its training, on other workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cerebro_automl.meta_device import meta_build, on_meta, tell_unchecked
from cerebro_automl.training.loop import EvalHooks, PassLoss, TrainHooks
from cerebro_automl.training.metrics import EvalResult, logged_means
from cerebro_automl.training.restore import check_optimizer_params
from cerebro_automl.training.schedulers import SchedulerConfig
from cerebro_automl.training.spec import TrainingSpec
from cerebro_automl.training.transfer import State

from ._lightning_trainer import LogCapture, UnitTrainer, attached, optimizer_and_schedulers

__all__ = ["LightningSpec"]


def _lightning_module_classes() -> tuple[type[Any], ...]:
    classes = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = __import__(name, fromlist=["LightningModule"])
            classes.append(module.LightningModule)
        except ImportError:
            pass
    if not classes:
        raise ImportError(
            "the Lightning adapter needs lightning or pytorch-lightning: pip install 'cerebro-automl[lightning]'"
        )
    return tuple(classes)


def _default_collate(x: Any, y: Any) -> Any:
    # What a DataLoader yields: [x, y] over a TensorDataset, the bare input for unlabeled data.
    return x if y is None else [x, y]


@dataclass(frozen=True, init=False)
class LightningSpec(TrainingSpec):
    """A TrainingSpec that trains ``module_fn(config)``, a LightningModule, unmodified.

    Args:
        module_fn: ``config -> LightningModule``.
        batch_size: an int, or the name of a config key holding one.
        eval_batch_size: batch size for ``validation_step`` (default 1024).
        collate: ``(x, y) -> batch`` handed to the steps; default ``[x, y]``
            (what a DataLoader over a TensorDataset yields), or ``x`` alone when
            the data is unlabeled (``y`` is None), as for Lightning's BoringModel.
            ``x`` and ``y`` keep the structure the data has (tensor, tuple, dict).
        train_transform: optional ``(x, y, generator) -> (x, y)`` on every training
            batch, before ``collate`` (see :class:`~cerebro_automl.TrainingSpec`).
        eval_transform: optional ``(x, y) -> (x, y)`` on every validation batch.
        logged: the names the module logs that a tuner may use as its metric
            (e.g. ``("val_loss", "val_acc")``); given, a wrong metric name
            fails before training, otherwise at the first epoch.
        device: ``"auto"`` (the worker's GPU when it has one), ``"cpu"`` or ``"cuda"``.
        precision: ``"32"``, ``"bf16-mixed"`` or ``"16-mixed"``, as
            ``Trainer(precision=...)``: ``training_step`` and ``validation_step`` run
            under ``torch.autocast``; with ``"16-mixed"`` a GradScaler scales the loss
            and unscales the gradients before ``on_before_optimizer_step``.
        gradient_clip_val: as ``Trainer(gradient_clip_val=...)``: the gradients' norm is
            clipped to it before every optimizer step (None: not clipped).
        accumulate_grad_batches: as ``Trainer(accumulate_grad_batches=...)``: the
            batches whose gradients add up to one optimizer step.
        frozen_base: the module's frozen parameters stay on the workers, and only
            what trains hops (default True; see :class:`~cerebro_automl.TrainingSpec`).
    """

    module_fn: Callable[[Mapping[str, Any]], Any] = field(init=False)  # (set by __init__, as every field)
    collate: Callable[[torch.Tensor, torch.Tensor], Any] = _default_collate
    logged: tuple[str, ...] | None = None
    _module_classes: tuple[type[Any], ...] = field(default=(), repr=False, compare=False)

    def __init__(
        self,
        module_fn: Callable[[Mapping[str, Any]], Any],
        *,
        batch_size: int | str = 32,
        eval_batch_size: int = 1024,
        collate: Callable | None = None,
        logged: Sequence[str] | None = None,
        device: str = "auto",
        train_transform: Callable | None = None,
        eval_transform: Callable | None = None,
        precision: str = "32",
        gradient_clip_val: float | None = None,
        accumulate_grad_batches: int = 1,
        frozen_base: bool = True,
    ) -> None:
        if not callable(module_fn):
            raise TypeError(f"module_fn is {module_fn!r}, but must be callable as module_fn(config)")
        if collate is not None and not callable(collate):
            raise TypeError(f"collate is {collate!r}, but must be callable as collate(x, y)")
        if logged is not None and (isinstance(logged, str) or not all(isinstance(n, str) for n in logged)):
            raise TypeError(f"logged is {logged!r}, but must be a list of logged names")
        object.__setattr__(self, "module_fn", module_fn)
        object.__setattr__(self, "collate", collate or _default_collate)
        object.__setattr__(self, "logged", tuple(logged) if logged is not None else None)
        object.__setattr__(self, "_module_classes", _lightning_module_classes())
        super().__init__(
            model_fn=module_fn,
            loss_fn=None,
            metrics={},
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            device=device,
            train_transform=train_transform,
            eval_transform=eval_transform,
            precision=precision,
            gradient_clip_val=gradient_clip_val,
            accumulate_grad_batches=accumulate_grad_batches,
            frozen_base=frozen_base,
        )

    @property
    def metric_names(self) -> list[str] | None:
        """``train_loss`` and the declared ``logged`` names; None when undeclared (checked at the first epoch)."""
        return None if self.logged is None else ["train_loss", *self.logged]

    # ---------------------------------------------------------- checks at add
    def validate_config(self, config: Mapping[str, Any]) -> None:
        """Build the module and call ``configure_optimizers`` on the meta device:
        a missing config key, a module of another kind, manual optimization or an
        unsupported optimizer set-up fail at ``add``, before any training."""
        self.resolve_batch_size(config)
        try:
            module = meta_build(lambda: self.module_fn(config))
        except KeyError as err:
            raise ValueError(f"config {dict(config)} lacks key {err.args[0]!r}, which module_fn reads") from None
        except Exception as err:  # cannot build on the meta device: a real error fails the model's first unit
            tell_unchecked(self.module_fn, config, err)
            return
        self._check_module(module)
        try:
            with on_meta():
                configured = module.configure_optimizers()
        except Exception as err:
            tell_unchecked(self.module_fn, config, err)
            return
        optimizer, _ = optimizer_and_schedulers(configured)
        check_optimizer_params(module, optimizer, config, *_ModuleTrainHooks.optimizer_built_by)

    def _check_module(self, module: Any) -> None:
        if not isinstance(module, self._module_classes):
            raise TypeError(
                f"module_fn returned {type(module).__name__}, but must return a LightningModule "
                "(lightning.pytorch or pytorch_lightning)"
            )
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(module).__name__} sets automatic_optimization = False, but cerebro_automl drives "
                "automatic optimization only: in manual optimization training_step runs the optimizer "
                "itself through the Trainer's strategy (self.optimizers(), self.manual_backward()), "
                "which a MOP unit does not have"
            )

    # ---------------------------------------------------------------- hooks
    def train_hooks(
        self, config: Mapping[str, Any], *, state: State | None, progress: dict[str, Any], epoch: int, step: int
    ) -> TrainHooks:
        """The module's own hooks in the one training loop (see the module's docstring)."""
        return _ModuleTrainHooks(self, state, progress, epoch)

    def eval_hooks(self, config: Mapping[str, Any], state: State) -> EvalHooks:
        """``validation_step`` on every batch, its ``self.log`` values summed."""
        return _ModuleEvalHooks(self, state)


class _ModuleTrainHooks(TrainHooks):
    """A LightningModule's automatic optimization in the training loop, hook for hook."""

    zero_grad_first = False  # Lightning zeroes the gradients after training_step
    optimizer_built_by = ("configure_optimizers()", "build it from self.parameters()")

    def __init__(self, spec: LightningSpec, state: State | None, progress: dict[str, Any], epoch: int) -> None:
        self.spec, self.progress = spec, progress
        self.first_batch = progress.get("batches", 0)  # batch_idx counts across the model-epoch
        self.trainer = UnitTrainer(
            current_epoch=epoch, global_step=state.get("steps", 0) if state else 0, training=True
        )
        self.capture = LogCapture(progress.setdefault("logged", {}))
        self.step_values = self.capture.latest
        self.extra_state = {"epoch": epoch}
        self.module: Any = None
        self.output: Any = None

    def attached(self, model: torch.nn.Module) -> attached:
        self.spec._check_module(model)
        self.module = model
        return attached(model, self.trainer, self.capture)

    def configure(self, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
        module: Any = model  # a LightningModule (see attached): its hooks are not nn.Module's
        return optimizer_and_schedulers(module.configure_optimizers())

    def epoch_start(self) -> None:
        self.module.on_train_epoch_start()

    def batch_start(self, x: Any, y: Any, rows: int, batch_idx: int) -> Any:
        batch = self.spec.collate(x, y)
        self.capture.batch_size = rows
        self.module.on_train_batch_start(batch, batch_idx)
        return batch

    def step_loss(self, model: torch.nn.Module, batch: Any, batch_idx: int) -> torch.Tensor | None:
        module: Any = model  # a LightningModule (see attached)
        output = self.output = module.training_step(batch, batch_idx)
        return output["loss"] if isinstance(output, Mapping) else output

    def before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.module.on_before_zero_grad(optimizer)

    def before_backward(self, loss: torch.Tensor) -> None:
        self.module.on_before_backward(loss)

    def after_backward(self) -> None:
        self.module.on_after_backward()

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.module.on_before_optimizer_step(optimizer)

    def after_optimizer_step(self, batch_idx: int) -> None:
        self.trainer.global_step += 1

    def batch_end(self, batch: Any, batch_idx: int) -> None:
        self.module.on_train_batch_end(self.output, batch, batch_idx)

    def pass_end(self, batches: int) -> None:
        self.progress["batches"] = self.first_batch + batches

    def epoch_end(self, loss: PassLoss) -> dict[str, float]:
        """``on_train_epoch_end``; the epoch's logged means (and ``train_loss``) for the schedulers."""
        self.module.on_train_epoch_end()
        self.capture.flush()
        monitored = logged_means([self.progress["logged"]])
        if "train_loss" not in monitored:
            loss_sum, samples = loss.total()
            monitored["train_loss"] = (self.progress["loss_sum"] + loss_sum) / max(
                self.progress["samples"] + samples, 1
            )
        self.progress["batches"] = 0
        return monitored


class _ModuleEvalHooks(EvalHooks):
    """``validation_step`` under the trainer stand-in; ``self.log`` values are the result."""

    def __init__(self, spec: LightningSpec, state: State) -> None:
        self.spec, self.samples = spec, 0
        self.trainer = UnitTrainer(
            current_epoch=state.get("epoch", 0), global_step=state.get("steps", 0), training=False
        )
        self.capture = LogCapture({})

    def attached(self, model: torch.nn.Module) -> attached:
        return attached(model, self.trainer, self.capture)

    def step(self, model: torch.nn.Module, x: Any, y: Any, rows: int, batch_idx: int) -> None:
        self.capture.batch_size = rows
        module: Any = model  # a LightningModule (module_fn's)
        module.validation_step(self.spec.collate(x, y), batch_idx)
        self.samples += rows

    def result(self) -> EvalResult:
        return EvalResult(None, {}, self.samples, 0.0, {}, logged=self.capture.sums)

    def empty(self) -> EvalResult:
        return EvalResult(None, {}, 0, 0.0, {})
