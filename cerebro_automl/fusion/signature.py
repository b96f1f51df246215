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

Containers of plain values (lists, tuples, dicts, sets) and dataclasses or
objects with ``to_dict`` (a HuggingFace config, a peft ``LoraConfig``) compare by
their values. Other attributes (a function, a tensor) must be the very same object
in both models: two lambdas made per config never match, whatever they compute,
so such configs train apart rather than wrongly together.

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

import dataclasses
import enum
import functools
import json
import warnings
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ..meta_device import meta_build

__all__ = ["Signatures", "Unfusable", "OPTIMIZER_OPTIONS"]

#: optimizer options that select code, not a value: members of a group must agree on them
OPTIMIZER_OPTIONS = ("nesterov", "amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")

_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)
_DEPTH = 6  # how deep containers are compared by value; deeper ones by identity


class Signatures:
    """The fusion signature of each config of one spec: configs with equal signatures
    may train in one group. The models built to compare are kept while this object
    lives, so an attribute compared by identity is never a reused address."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._keep: list[Any] = []

    def of(self, config: Mapping[str, Any]) -> Hashable:
        """The signature of ``config`` (a hashable value)."""
        model, optimizer = meta_build(lambda: self._built(config))
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

    def _built(self, config: Mapping[str, Any]) -> tuple[torch.nn.Module, Any]:
        model = self.spec.model_fn(config)
        return model, self.spec.optimizer_fn(config, model.parameters()) if self.spec.optimizer_fn else None


class Unfusable(Exception):
    """A configuration that trains alone, and why."""


def _module_signature(name: str, module: torch.nn.Module) -> Hashable:
    attributes = tuple(
        (key, _value_signature(value))
        for key, value in sorted(vars(module).items())
        if not key.startswith("_") and key != "training"
    )
    return (name, f"{type(module).__module__}.{type(module).__qualname__}", module.training, attributes)


def _value_signature(value: Any, depth: int = 0) -> Hashable:
    """``value`` as the signature compares it: plain values and their containers by
    value (a few levels deep), a submodule by its class, anything else by identity."""
    if isinstance(value, (_PLAIN, enum.Enum)):
        return ("value", repr(value))
    if isinstance(value, torch.nn.Module):  # a submodule under another name: compared where it is registered
        return ("module", type(value).__qualname__)
    if depth < _DEPTH:
        inner = functools.partial(_value_signature, depth=depth + 1)
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(inner(v) for v in value))
        if isinstance(value, (set, frozenset)):
            return ("set", tuple(sorted(repr(inner(v)) for v in value)))
        if isinstance(value, dict):
            return ("dict", tuple(sorted(((inner(k), inner(v)) for k, v in value.items()), key=repr)))
        fields = _fields(value)
        if fields is not None:
            return (f"{type(value).__module__}.{type(value).__qualname__}", inner(fields))
    return ("object", id(value))


def _fields(value: Any) -> dict | None:
    """A dataclass's fields or what a config object's ``to_dict()`` returns, with its
    attributes (its ``vars``: private ones too, which both may leave out, such as
    HuggingFace's attention choice); None for any other object."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields: Any = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif callable(getattr(type(value), "to_dict", None)):
        try:
            with warnings.catch_warnings():  # e.g. deprecated properties a config's to_dict reads
                warnings.simplefilter("ignore")
                fields = value.to_dict()
        except Exception:  # a to_dict that needs arguments, or fails: compared by identity
            return None
        if not isinstance(fields, dict):
            return None
    else:
        return None
    return {**fields, **{f"__{k}": v for k, v in getattr(value, "__dict__", {}).items()}}


def _optimizer_signature(optimizer: Any) -> Hashable:
    if optimizer is None:
        return None
    groups = getattr(optimizer, "param_groups", [])
    options = tuple(tuple((k, repr(g.get(k))) for k in OPTIMIZER_OPTIONS if k in g) for g in groups)
    return (type(optimizer).__qualname__, len(groups), options)
