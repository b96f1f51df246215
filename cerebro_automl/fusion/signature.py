"""Which configurations may share a fusion group: those whose models are the same
computation up to the values of their tensors.

The group runs one module (its first member's) with every member's weights, so
two configs may fuse only when their models are built alike: the same module
classes in the same places, the same non-tensor attributes (a dropout rate, an
activation, a flag a forward branches on), the same weight names, shapes and
dtypes, the same batch size, and optimizers of one type with the same non-numeric
options. Numeric hyperparameters (learning rate, momentum, betas, weight decay)
may differ: the fused optimizer takes them per member. A spec may also name the
only keys that may differ (``TrainingSpec(fuse_keys=...)``).

Attributes that are not plain values (a function, a module of its own) must be
the very same object in both models: two lambdas made per config never match,
whatever they compute, so such configs train apart rather than wrongly together.

>>> import torch
>>> spec = type("Spec", (), {"fuse_keys": None, "optimizer_fn": None,
...     "model_fn": staticmethod(lambda c: torch.nn.Sequential(torch.nn.Linear(2, c["w"]), torch.nn.Dropout(c["p"]))),
...     "resolve_batch_size": lambda self, c: 8})()
>>> probe = Signatures(spec)
>>> probe.of({"w": 4, "p": 0.1}) == probe.of({"w": 4, "p": 0.1, "lr": 1.0})
True
>>> probe.of({"w": 4, "p": 0.1}) == probe.of({"w": 4, "p": 0.5})
False
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ..meta_device import on_meta

__all__ = ["Signatures", "Unfusable", "OPTIMIZER_OPTIONS"]

#: optimizer options that select code, not a value: members of a group must agree on them
OPTIMIZER_OPTIONS = ("nesterov", "amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)


class Signatures:
    """The fusion signature of each config of one spec: configs with equal signatures
    may train in one group. The models built to compare are kept while this object
    lives, so an attribute compared by identity is never a reused address."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._keep: list[Any] = []

    def of(self, config: Mapping[str, Any]) -> Hashable:
        """The signature of ``config`` (a hashable value)."""
        with on_meta():
            model = self.spec.model_fn(config)
            optimizer = self.spec.optimizer_fn(config, model.parameters()) if self.spec.optimizer_fn else None
        self._keep.append(model)
        parts: list[Hashable] = [
            ("batch_size", self.spec.resolve_batch_size(config)),
            ("modules", tuple(_module_signature(name, m) for name, m in model.named_modules())),
            ("weights", tuple((n, tuple(t.shape), str(t.dtype)) for n, t in model.state_dict().items())),
            ("optimizer", _optimizer_signature(optimizer)),
        ]
        keys = self.spec.fuse_keys
        if keys is not None:
            fixed = {k: v for k, v in config.items() if k not in keys}
            parts.append(("config", json.dumps(fixed, sort_keys=True, default=repr)))
        return tuple(parts)


class Unfusable(Exception):
    """A configuration that trains alone, and why."""


def _module_signature(name: str, module: torch.nn.Module) -> Hashable:
    attributes = tuple(
        (key, _value_signature(value))
        for key, value in sorted(vars(module).items())
        if not key.startswith("_") and key != "training"
    )
    return (name, f"{type(module).__module__}.{type(module).__qualname__}", module.training, attributes)


def _value_signature(value: Any) -> Hashable:
    if isinstance(value, _PLAIN):
        return ("value", repr(value))
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return ("value", repr(value))
    if isinstance(value, torch.nn.Module):  # a submodule under another name: compared where it is registered
        return ("module", type(value).__qualname__)
    return ("object", id(value))


def _optimizer_signature(optimizer: Any) -> Hashable:
    if optimizer is None:
        return None
    groups = getattr(optimizer, "param_groups", [])
    options = tuple(tuple((k, repr(g.get(k))) for k in OPTIMIZER_OPTIONS if k in g) for g in groups)
    return (type(optimizer).__qualname__, len(groups), options)
