"""PyTorch Lightning modules on MOP, unmodified: ``LightningSpec(module_fn)``.

``module_fn(config)`` returns a ``LightningModule`` (from ``lightning.pytorch``
or ``pytorch_lightning``). The result is a :class:`~cerebro_automl.TrainingSpec`
that every tuner accepts. Each unit drives the module's own hooks in a small
loop, the way Lightning's automatic optimization does, without a ``Trainer``:
``benchmarks/bench_lightning.py`` measures a Trainer per unit at several times
the overhead budget, and this loop at a few percent of a plain-PyTorch unit.

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

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from cerebro_automl.data import Shard
from cerebro_automl.training import (EvalResult, PhaseClock, State, TrainingSpec, autocast, batches,
                                     build_model, check_deadline, clone_tensors, grad_scaler, logged_means,
                                     losses_checked, pick_device, restore_optimizer, seed_torch, to_floats,
                                     to_host, unit_generators, unit_seed)

__all__ = ["LightningSpec"]


def _lightning_module_classes() -> tuple[type, ...]:
    classes = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            module = __import__(name, fromlist=["LightningModule"])
            classes.append(module.LightningModule)
        except ImportError:
            pass
    if not classes:
        raise ImportError("the Lightning adapter needs lightning or pytorch-lightning: "
                          "pip install 'cerebro-automl[lightning]'")
    return tuple(classes)


def _not_used(*args: Any) -> Any:  # TrainingSpec's plain-PyTorch hooks; Lightning uses its own
    raise RuntimeError("a LightningSpec trains through the module's own hooks")


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
    """
    module_fn: Callable[[Mapping[str, Any]], Any] = None
    collate: Callable[[torch.Tensor, torch.Tensor], Any] = _default_collate
    logged: tuple[str, ...] | None = None
    _module_classes: tuple[type, ...] = field(default=(), repr=False, compare=False)

    def __init__(self, module_fn: Callable[[Mapping[str, Any]], Any], *, batch_size: int | str = 32,
                 eval_batch_size: int = 1024, collate: Callable | None = None,
                 logged: Sequence[str] | None = None, device: str = "auto",
                 train_transform: Callable | None = None, eval_transform: Callable | None = None,
                 precision: str = "32") -> None:
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
        super().__init__(model_fn=module_fn, optimizer_fn=_not_used, loss_fn=_not_used, metrics={},
                         batch_size=batch_size, eval_batch_size=eval_batch_size, device=device,
                         train_transform=train_transform, eval_transform=eval_transform,
                         precision=precision)

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
            with torch.device("meta"):
                module = self.module_fn(config)
        except KeyError as err:
            raise ValueError(f"config {dict(config)} lacks key {err.args[0]!r}, which module_fn reads") from None
        except Exception:
            return  # cannot build on the meta device: a real error fails the model's first unit
        self._check_module(module)
        try:
            with torch.device("meta"):
                configured = module.configure_optimizers()
        except Exception:
            return
        _optimizer_and_schedulers(configured)

    def _check_module(self, module: Any) -> None:
        if not isinstance(module, self._module_classes):
            raise TypeError(f"module_fn returned {type(module).__name__}, but must return a LightningModule "
                            "(lightning.pytorch or pytorch_lightning)")
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(module).__name__} sets automatic_optimization = False, but cerebro_automl drives "
                "automatic optimization only: in manual optimization training_step runs the optimizer "
                "itself through the Trainer's strategy (self.optimizers(), self.manual_backward()), "
                "which a MOP unit does not have")

    # ---------------------------------------------------------------- units
    def train_pass(self, config: Mapping[str, Any], state: State | None,
                   shard: Shard, *, seed: int, epoch: int, partition: int,
                   step: int, epoch_end: bool, progress: dict[str, Any],
                   deadline: float | None = None, fresh_hyperparameters: bool = False) -> State:
        device = pick_device(self)
        clock = PhaseClock(device)
        clock.mark()
        with torch.random.fork_rng(devices=[]):
            module = build_model(self, config, state["model"] if state else None, seed).to(device)
        self._check_module(module)
        module.train()
        global_step = state.get("steps", 0) if state else 0
        batches_before = progress.get("batches", 0)
        trainer = _UnitTrainer(current_epoch=epoch, global_step=global_step, training=True)
        capture = _LogCapture(progress.setdefault("logged", {}))
        losses, sizes = [], []
        check_each = device.type == "cpu"  # a GPU's losses are read at the end, together
        with _attached(module, trainer, capture), torch.random.fork_rng(devices=[]):
            optimizer, schedulers = _optimizer_and_schedulers(module.configure_optimizers())
            if state:
                restore_optimizer(optimizer, [c["scheduler"] for c in schedulers], state,
                                  state.get("scheduler") or [], fresh_hyperparameters=fresh_hyperparameters)
            scaler = grad_scaler(self, device, state)
            clock.mark()
            useed = unit_seed(seed, epoch, partition)
            seed_torch(useed)
            shuffle, augment = unit_generators(useed, device)
            if step == 0:
                module.on_train_epoch_start()
            local_idx, rows = -1, 0
            check_deadline(deadline, 0.0)
            for local_idx, (x, y, n) in enumerate(batches(self, shard, self.resolve_batch_size(config),
                                                          device, shuffle, augment)):
                batch_idx = batches_before + local_idx
                batch = self.collate(x, y)
                capture.batch_size = n
                module.on_train_batch_start(batch, batch_idx)
                with autocast(self, device):
                    output = module.training_step(batch, batch_idx)
                loss = output["loss"] if isinstance(output, Mapping) else output
                if loss is not None:  # None skips the batch, as in Lightning
                    losses.append(loss.detach())
                    sizes.append(n)
                    if check_each:
                        value = float(losses[-1])
                        if not math.isfinite(value):
                            raise ValueError(f"loss is {value} at epoch {epoch}, partition {partition}, "
                                             f"batch {batch_idx}")
                    module.on_before_zero_grad(optimizer)
                    optimizer.zero_grad(set_to_none=True)
                    module.on_before_backward(loss)
                    (loss if scaler is None else scaler.scale(loss)).backward()
                    module.on_after_backward()
                    if scaler is not None:
                        scaler.unscale_(optimizer)  # the hook sees true gradients, as in Lightning
                    module.on_before_optimizer_step(optimizer)
                    if scaler is None:
                        optimizer.step()
                    else:
                        scaler.step(optimizer)
                        scaler.update()
                    trainer.global_step += 1
                    _step_schedulers(schedulers, "step", batch_idx + 1, capture.latest)
                module.on_train_batch_end(output, batch, batch_idx)
                rows += n
                check_deadline(deadline, rows / len(shard))
            progress["batches"] = batches_before + local_idx + 1
            loss_sum = losses_checked(losses, sizes, epoch, partition)
            if epoch_end:
                module.on_train_epoch_end()
                capture.flush()
                monitored = logged_means([progress["logged"]])
                monitored.setdefault("train_loss", (progress["loss_sum"] + loss_sum)
                                     / max(progress["samples"] + sum(sizes), 1))
                _step_schedulers(schedulers, "epoch", epoch + 1, monitored)
                progress["batches"] = 0
            clock.mark()
        capture.flush()
        new_state = to_host({
            "model": dict(module.state_dict()),
            "optimizer": optimizer.state_dict(),
            "scheduler": [c["scheduler"].state_dict() for c in schedulers],
            "samples": sum(sizes),
            "steps": trainer.global_step,
            "epoch": epoch,
            **({"scaler": scaler.state_dict()} if scaler is not None else {}),
        })
        clock.mark()
        new_state["loss_sum"] = loss_sum
        new_state["phase_seconds"] = clock.seconds(("transfer_in", "compute", "transfer_out"))
        return new_state

    def evaluate_pass(self, config: Mapping[str, Any], state: State,
                      shard: Shard | None, *, seed: int) -> EvalResult:
        if shard is None or len(shard) == 0:
            return EvalResult(None, {}, 0, 0.0, {})
        device = pick_device(self)
        with torch.random.fork_rng(devices=[]):
            # A copy: the state's tensors are shared with the next unit and the other
            # shards' evaluations, and a module may write its buffers in validation.
            weights = clone_tensors(state["model"]) if device.type == "cpu" else state["model"]
            module = build_model(self, config, weights, seed).to(device)
        module.eval()
        trainer = _UnitTrainer(current_epoch=state.get("epoch", 0), global_step=state["steps"],
                               training=False)
        capture = _LogCapture({})
        with _attached(module, trainer, capture), torch.no_grad():
            for batch_idx, (x, y, n) in enumerate(batches(self, shard, self.eval_batch_size, device,
                                                          None, None)):
                capture.batch_size = n
                with autocast(self, device):
                    module.validation_step(self.collate(x, y), batch_idx)
        capture.flush()
        return EvalResult(None, {}, len(shard), 0.0, {}, logged=capture.sums)


# ------------------------------------------------------------------ helpers
class _UnitTrainer:
    """What a module may read from ``self.trainer`` inside a MOP unit."""

    def __init__(self, *, current_epoch: int, global_step: int, training: bool) -> None:
        self.current_epoch, self.global_step = current_epoch, global_step
        self.training, self.validating = training, not training
        self.sanity_checking = self.testing = self.predicting = False
        self.global_rank = self.local_rank = self.node_rank = 0
        self.world_size = self.num_devices = self.num_nodes = 1
        self.is_global_zero = True
        self.logger, self.loggers = None, []

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"trainer.{name} is not available: cerebro_automl drives this module without a Trainer "
            "(available: current_epoch, global_step, training, validating, global_rank, world_size, ...)")


class _LogCapture:
    """Stands in for ``LightningModule.log``: weighted sums per name for the epoch report.

    Logged tensors stay on their device until :meth:`flush` reads them all at once
    (reading one waits for the GPU) and adds them up in the order they were logged.
    """

    def __init__(self, sums: dict[str, list[float]]) -> None:
        self.sums, self.latest, self.batch_size = sums, {}, 1
        self._pending: list[tuple[str, Any, int]] = []

    def __call__(self, name: str, value: Any, *args: Any, reduce_fx: Any = "mean",
                 batch_size: int | None = None, **kwargs: Any) -> None:
        if reduce_fx not in ("mean", torch.mean):
            raise ValueError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): only 'mean' is supported, "
                             "since values are combined across partitions as weighted means")
        if not isinstance(value, (torch.Tensor, int, float)):
            raise TypeError(f"self.log({name!r}, {type(value).__name__}): log a number or a tensor "
                            "(for a torchmetrics Metric, log metric(preds, target))")
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        self._pending.append((name, value, batch_size if batch_size is not None else self.batch_size))
        self.latest[name] = value  # read (a wait) only by a scheduler that monitors it

    def flush(self) -> None:
        """Add the values logged since the last flush to ``sums``."""
        numbers = to_floats([value for _, value, _ in self._pending])
        for (name, _, weight), number in zip(self._pending, numbers):
            acc = self.sums.setdefault(name, [0.0, 0.0])
            acc[0] += number * weight
            acc[1] += weight
        self._pending = []


class _attached:
    """Attach the trainer stand-in and the log capture to a module for one pass."""

    def __init__(self, module: Any, trainer: _UnitTrainer, capture: _LogCapture) -> None:
        self.module, self.trainer, self.capture = module, trainer, capture

    def __enter__(self) -> None:
        self.module.trainer = self.trainer  # the setter reaches nested LightningModules too
        self.module.log = self.capture      # an instance attribute: the class is not touched

    def __exit__(self, *exc: Any) -> None:
        self.module.trainer = None
        del self.module.log


def _optimizer_and_schedulers(configured: Any) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """Normalize every ``configure_optimizers`` return form to one optimizer and scheduler configs."""
    optimizers, schedulers = [], []
    if isinstance(configured, torch.optim.Optimizer):
        optimizers = [configured]
    elif isinstance(configured, Mapping):
        optimizers = [configured.get("optimizer")]
        if configured.get("lr_scheduler") is not None:
            schedulers = [configured["lr_scheduler"]]
        if "monitor" in configured and schedulers and not isinstance(schedulers[0], Mapping):
            schedulers = [{"scheduler": schedulers[0], "monitor": configured["monitor"]}]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and \
            isinstance(configured[0], (list, tuple)):
        optimizers, schedulers = list(configured[0]), list(configured[1])
    elif isinstance(configured, (list, tuple)):
        optimizers = [c["optimizer"] if isinstance(c, Mapping) else c for c in configured]
        schedulers = [c["lr_scheduler"] for c in configured if isinstance(c, Mapping) and c.get("lr_scheduler")]
    if len(optimizers) != 1:
        raise ValueError(f"configure_optimizers returned {len(optimizers)} optimizers, but automatic "
                         "optimization trains with exactly one (Lightning 2 needs manual optimization "
                         "for several, which cerebro_automl does not drive)")
    if not isinstance(optimizers[0], torch.optim.Optimizer):
        raise TypeError(f"configure_optimizers gave {optimizers[0]!r} as the optimizer, "
                        "but it must be a torch.optim.Optimizer")
    return optimizers[0], [_scheduler_config(s) for s in schedulers]


def _scheduler_config(scheduler: Any) -> dict[str, Any]:
    config = dict(scheduler) if isinstance(scheduler, Mapping) else {"scheduler": scheduler}
    config.setdefault("interval", "epoch")
    config.setdefault("frequency", 1)
    config.setdefault("monitor", None)
    if config["interval"] not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler interval is {config['interval']!r}, but must be 'epoch' or 'step'")
    if isinstance(config["scheduler"], torch.optim.lr_scheduler.ReduceLROnPlateau) and not config["monitor"]:
        raise ValueError("lr_scheduler is a ReduceLROnPlateau without a 'monitor'; return "
                         "{'scheduler': ..., 'monitor': 'train_loss'} (a value logged in training_step)")
    return config


def _step_schedulers(schedulers: list[dict[str, Any]], interval: str, count: int,
                     values: Mapping[str, float]) -> None:
    """Step the schedulers of ``interval`` whose ``frequency`` divides ``count`` (Lightning's rule)."""
    for config in schedulers:
        if config["interval"] != interval or count % config["frequency"]:
            continue
        if config["monitor"] is None:
            config["scheduler"].step()
            continue
        if config["monitor"] not in values:
            raise ValueError(
                f"lr_scheduler monitors {config['monitor']!r}, but at the end of a training "
                f"{interval} only these values are known: {sorted(values)}; under MOP an epoch's "
                "validation runs after its training on other workers, so monitor a value logged "
                "in training_step")
        config["scheduler"].step(values[config["monitor"]])
