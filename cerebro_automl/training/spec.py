"""TrainingSpec: what to train, in plain PyTorch, and the checks on it and on a config.

Example:
    >>> import torch
    >>> from cerebro_automl.training import accuracy
    >>> spec = TrainingSpec(
    ...     model_fn=lambda c: torch.nn.Linear(4, 2),
    ...     optimizer_fn=lambda c, params: torch.optim.SGD(params, lr=c["lr"]),
    ...     loss_fn=torch.nn.functional.cross_entropy,
    ...     metrics={"accuracy": accuracy},
    ...     batch_size=32,
    ... )
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..data.structure import call_model
from ..features import FrozenFeatures, backbone
from ..meta_device import meta_build, tell_unchecked
from .loop import EvalHooks, TrainHooks
from .plain import PlainEvalHooks, PlainTrainHooks
from .precision import PRECISIONS
from .restore import check_optimizer_params
from .schedulers import WarmupDecay
from .transfer import State

__all__ = ["TrainingSpec"]

# The functions the plain hooks call, as the error for a missing one names them.
_FUNCTIONS = {
    "optimizer_fn": "optimizer_fn(config, parameters) -> torch.optim.Optimizer",
    "loss_fn": "loss_fn(outputs, targets) -> scalar tensor",
}


# The names a metric cannot take: reports carry val_loss and val_seconds of their own.
RESERVED_METRICS = frozenset({"loss", "seconds"})


@dataclass(frozen=True)
class TrainingSpec:
    """What to train, in plain PyTorch.

    Args:
        model_fn: ``config -> nn.Module``.
        optimizer_fn: ``(config, parameters) -> torch.optim.Optimizer``. Required,
            unless a subclass trains through hooks of its own (see :meth:`train_hooks`).
        loss_fn: ``(outputs, targets) -> scalar tensor``, a mean over the batch.
        metrics: named ``(outputs, targets) -> scalar tensor`` batch means,
            reported on the validation set as ``val_<name>``.
        batch_size: an int, or the name of a config key holding one.
        scheduler_fn: optional ``(config, optimizer) -> LRScheduler``, stepped
            once per epoch.
        eval_batch_size: batch size for validation (default 1024).
        device: ``"auto"`` (CUDA when the worker has a GPU), ``"cpu"`` or ``"cuda"``.
        forward_fn: optional ``(model, x, y) -> (outputs, targets)``, for models that
            are not called as ``model(x)`` (tensor), ``model(*x)`` (tuple) or
            ``model(**x)`` (dict), or whose targets are not ``y`` (an autoencoder
            returns ``(model(x), x)``).
        train_transform: optional ``(x, y, generator) -> (x, y)``, run on every
            training batch on the unit's device (augmentation); ``generator`` is a
            ``torch.Generator`` on that device seeded from the unit's seed, so
            augmented runs stay bitwise reproducible.
        eval_transform: optional ``(x, y) -> (x, y)``, run on every validation batch.
        precision: ``"32"`` (float32), ``"bf16-mixed"`` or ``"16-mixed"``: the forward
            pass and loss under ``torch.autocast`` in bfloat16 or float16, as
            Lightning's ``Trainer(precision=...)``. With ``"16-mixed"`` a
            ``GradScaler`` scales the loss, and its state hops with the optimizer's.
        device_data_fraction: on a GPU, a worker copies a partition's in-memory
            shards to the device once when they take at most this fraction of the
            device's free memory (default 0.5), and slices batches there; otherwise
            batches are gathered in pinned host memory and copied while the GPU
            computes.
        features: optional :class:`~cerebro_automl.FrozenFeatures`: a frozen
            backbone whose layer ``config[features.layer_key]`` the model reads;
            ``model_fn`` then builds only the trainable part, which receives that
            layer's output as its input. Each worker computes the features of its
            partitions once; they never train and never hop.
        lr_schedule: optional :class:`~cerebro_automl.training.schedulers.WarmupDecay`:
            the learning rate of every optimizer step, warmed up and decayed over the
            model's budget (the config's learning rate times the schedule's
            multiplier). Not with ``scheduler_fn``.
        gradient_clip_val: clip the gradients' total norm (2-norm, over the
            optimizer's parameters) to this value before every optimizer step, as
            ``torch.nn.utils.clip_grad_norm_`` and Lightning's ``Trainer(gradient_clip_val=...)``
            do; None (default): no clipping.
        accumulate_grad_batches: add up the gradients of this many batches (each
            loss divided by it) before one optimizer step (default 1). A unit that
            ends within a group steps on the batches it has: gradients do not hop.
        frozen_base: a model's frozen parameters (``requires_grad`` False: a peft
            adapter's base, a frozen backbone) stay on the worker that built them,
            kept between units and shared by the configurations that hold the same
            ones; a unit moves, and a checkpoint holds, only the trainable parameters,
            the buffers and the optimizer's state (default True). False: the whole
            model hops, and every unit rebuilds it.
        fuse_keys: with ``Session(fuse=k)``, the only config keys whose values may
            differ within a fusion group (say ``("lr", "momentum")``); None: any
            keys, as long as the models are built alike (see the Fused models guide).

    ``loss_fn(outputs, targets)`` and each metric receive the targets as they are:
    a tensor, a tuple or dict of tensors, or None for unlabeled data.
    """

    model_fn: Callable[[Mapping[str, Any]], torch.nn.Module]
    optimizer_fn: Callable[[Mapping[str, Any], Any], torch.optim.Optimizer] | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = torch.nn.functional.cross_entropy
    metrics: Mapping[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    batch_size: int | str = 32
    scheduler_fn: Callable[[Mapping[str, Any], torch.optim.Optimizer], Any] | None = None
    eval_batch_size: int = 1024
    device: str = "auto"
    forward_fn: Callable[[torch.nn.Module, Any, Any], tuple[Any, Any]] | None = None
    train_transform: Callable[[Any, Any, torch.Generator], tuple[Any, Any]] | None = None
    eval_transform: Callable[[Any, Any], tuple[Any, Any]] | None = None
    precision: str = "32"
    device_data_fraction: float = 0.5
    features: FrozenFeatures | None = None
    fuse_keys: tuple[str, ...] | None = None
    lr_schedule: WarmupDecay | None = None
    gradient_clip_val: float | None = None
    accumulate_grad_batches: int = 1
    frozen_base: bool = True

    def __post_init__(self) -> None:
        self._check_functions()
        if self.fuse_keys is not None:
            if isinstance(self.fuse_keys, str) or not all(isinstance(k, str) for k in self.fuse_keys):
                raise TypeError(f"fuse_keys is {self.fuse_keys!r}, but must be a tuple of config keys (str)")
            object.__setattr__(self, "fuse_keys", tuple(self.fuse_keys))
        self._check_features()
        if not isinstance(self.metrics, Mapping):
            raise TypeError(f"metrics is {self.metrics!r}, but must be a dict of name -> callable")
        for name, fn in self.metrics.items():
            if not isinstance(name, str) or not callable(fn):
                raise TypeError(f"metrics[{name!r}] is {fn!r}, but must be callable with a str name")
            if name in RESERVED_METRICS or not name:
                raise ValueError(
                    f"metrics has a metric named {name!r}, but a name must be non-empty and not one of "
                    f"{sorted(RESERVED_METRICS)}: the session reports val_loss and val_seconds itself"
                )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, (int, str)):
            raise TypeError(f"batch_size is {self.batch_size!r}, but must be a positive int or a config key")
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            raise ValueError(f"batch_size is {self.batch_size}, but must be a positive int")
        if self.batch_size == "":
            raise ValueError("batch_size is '', but must be a positive int or a config key's name")
        if not isinstance(self.eval_batch_size, int) or self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size is {self.eval_batch_size!r}, but must be a positive int")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device is {self.device!r}, but must be 'auto', 'cpu' or 'cuda'")
        if self.lr_schedule is not None:
            if not isinstance(self.lr_schedule, WarmupDecay):
                raise TypeError(f"lr_schedule is {self.lr_schedule!r}, but must be a WarmupDecay or None")
            if self.scheduler_fn is not None:
                raise ValueError(
                    "lr_schedule and scheduler_fn are both set, but each sets the learning rate: "
                    "give one (a scheduler_fn may return {'scheduler': s, 'interval': 'step'} to step per batch)"
                )
        clip = self.gradient_clip_val
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 < clip < math.inf
        ):
            raise ValueError(f"gradient_clip_val is {clip!r}, but must be a finite positive number or None")
        accumulate = self.accumulate_grad_batches
        if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
            raise ValueError(f"accumulate_grad_batches is {accumulate!r}, but must be an int >= 1")
        if not isinstance(self.frozen_base, bool):
            raise TypeError(f"frozen_base is {self.frozen_base!r}, but must be True or False")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision is {self.precision!r}, but must be one of {PRECISIONS}")
        fraction = self.device_data_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"device_data_fraction is {fraction!r}, but must be a number from 0 to 1")

    def _check_functions(self) -> None:
        if not callable(self.model_fn):
            raise TypeError(f"model_fn is {self.model_fn!r}, but must be callable")
        # optimizer_fn and loss_fn drive the plain hooks; a spec with hooks of its own may omit them.
        plain = type(self).train_hooks is TrainingSpec.train_hooks
        for name, form in _FUNCTIONS.items():
            value = getattr(self, name)
            if value is None and plain:
                raise TypeError(
                    f"{name} is None, but a TrainingSpec trains with {form} (only a spec "
                    "whose train_hooks build the optimizer and the loss, as LightningSpec's "
                    "do, may leave it out)"
                )
            if value is not None and not callable(value):
                raise TypeError(f"{name} is {value!r}, but must be callable")
        for name in ("forward_fn", "train_transform", "eval_transform", "scheduler_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name} is {getattr(self, name)!r}, but must be callable or None")

    def _check_features(self) -> None:
        if self.features is None:
            return
        if not isinstance(self.features, FrozenFeatures):
            raise TypeError(f"features is {self.features!r}, but must be a FrozenFeatures or None")
        for name in ("train_transform", "eval_transform"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name} is set together with features, but the features are computed once from "
                    "the rows as they are, so a transform of the rows cannot reach them (and random "
                    "augmentation would make every pass differ); preprocess the input inside "
                    "backbone_fn's module, or train without FrozenFeatures"
                )

    def forward(self, model: torch.nn.Module, x: Any, y: Any) -> tuple[Any, Any]:
        """``(outputs, targets)`` of one batch: ``forward_fn``, or the model called on ``x``
        (a HuggingFace ``ModelOutput``'s ``logits``, as the loss and metrics take them)."""
        if self.forward_fn is None:
            return model_logits(call_model(model, x)), y
        out = self.forward_fn(model, x, y)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"forward_fn returned {type(out).__name__}, but must return (outputs, targets)")
        return out

    def transform(self, x: Any, y: Any, generator: torch.Generator | None) -> tuple[Any, Any]:
        """A batch after ``train_transform`` (with a generator) or ``eval_transform`` (without)."""
        fn, args = (self.train_transform, (generator,)) if generator is not None else (self.eval_transform, ())
        if fn is None:
            return x, y
        out = fn(x, y, *args)
        if not (isinstance(out, tuple) and len(out) == 2):
            name = "train_transform" if generator is not None else "eval_transform"
            raise TypeError(f"{name} returned {type(out).__name__}, but must return (x, y)")
        return out

    @property
    def metric_names(self) -> list[str] | None:
        """The history columns an epoch produces; None where a subclass learns them while
        training (the Lightning adapter, from ``self.log``)."""
        return ["train_loss", "val_loss"] + [f"val_{name}" for name in self.metrics]

    # What the one training loop and the validation pass ask of the model code, per
    # pass. A subclass (the Lightning adapter) returns hooks of its own.
    def train_hooks(
        self, config: Mapping[str, Any], *, state: State | None, progress: dict[str, Any], epoch: int, step: int
    ) -> TrainHooks:
        """The hooks of one training pass of ``config`` from ``state``, in model-epoch
        ``epoch`` at unit ``step`` of it; ``progress`` holds the epoch's sums so far
        (before this pass), and the hooks may keep sums of their own there."""
        return PlainTrainHooks(self, config)

    def eval_hooks(self, config: Mapping[str, Any], state: State) -> EvalHooks:
        """The hooks of one validation pass of ``config`` with ``state``."""
        return PlainEvalHooks(self)

    def resolve_batch_size(self, config: Mapping[str, Any]) -> int:
        """The batch size for ``config``; raises naming the value when it is not a positive int."""
        value, source = self.batch_size, "batch_size"
        if isinstance(value, str):
            if value not in config:
                raise ValueError(f"batch_size names config key {value!r}, which config {dict(config)} lacks")
            value, source = config[value], f"config[{value!r}] (the batch size)"
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{source} is {value!r}, but must be a positive int")
        return value

    def validate_config(self, config: Mapping[str, Any]) -> None:
        """Build the model and optimizer on the meta device (no memory, no compute)
        so that a config missing a key, or an optimizer that lacks some of the
        model's trainable parameters, fails before any training starts."""
        self.resolve_batch_size(config)
        if self.lr_schedule is not None:
            self.lr_schedule.horizon(config, 1)  # a config key it names must hold a budget
        if self.features is not None:
            self.features.layer_of(config)
            # Built and checked once (then cached): a trainable parameter or a layer path the
            # backbone lacks fails here, before any training; the local executor reuses it.
            backbone(self.features, torch.device("cpu"))
        try:
            model, optimizer = meta_build(lambda: self._built_on_meta(config))
        except _NotAModule as err:
            raise TypeError(f"model_fn returned {err}, but must return a torch.nn.Module") from None
        except _NotAnOptimizer as err:
            raise TypeError(
                f"optimizer_fn returned {err} for config {dict(config)}, but must return a torch.optim.Optimizer "
                "(build it from the parameters it is given)"
            ) from None
        except KeyError as err:
            raise ValueError(
                f"config {dict(config)} lacks key {err.args[0]!r}, which model_fn, optimizer_fn or scheduler_fn reads"
            ) from None
        except Exception as err:
            # Some code cannot run on the meta device (data-dependent init); a real error
            # surfaces in the model's first unit and fails that model only. Said once per
            # model_fn, since the check the user relies on is skipped.
            tell_unchecked(self.model_fn, config, err)
            return
        if optimizer is not None:  # else train_hooks of its own build the optimizer
            check_optimizer_params(model, optimizer, config)

    def _built_on_meta(self, config: Mapping[str, Any]) -> tuple[torch.nn.Module, Any]:
        """The model, its optimizer (None without ``optimizer_fn``) and scheduler, built."""
        model = self.model_fn(config)
        if not isinstance(model, torch.nn.Module):
            raise _NotAModule(type(model).__name__)
        if self.optimizer_fn is None:
            return model, None
        optimizer = self.optimizer_fn(config, model.parameters())
        if not hasattr(optimizer, "param_groups"):  # before scheduler_fn, which would fail on it
            raise _NotAnOptimizer(type(optimizer).__name__)
        if self.scheduler_fn is not None:
            self.scheduler_fn(config, optimizer)
        return model, optimizer


def model_logits(out: Any) -> Any:
    """``out["logits"]`` when ``out`` is a HuggingFace ``ModelOutput`` that holds logits,
    else ``out`` (found by its class, so that transformers need not be installed).

    >>> model_logits(torch.zeros(2))
    tensor([0., 0.])
    """
    if isinstance(out, Mapping) and any(c.__name__ == "ModelOutput" for c in type(out).__mro__):
        logits = out.get("logits")
        if logits is not None:
            return logits
    return out


class _NotAModule(Exception):
    """model_fn returned something other than a torch.nn.Module (its type name)."""


class _NotAnOptimizer(Exception):
    """optimizer_fn returned something without param_groups (its type name)."""
