"""The torch calls a model's forward makes, recorded once by calling it on a stand-in
for its input: a tensor-like ``Symbol`` that torch hands back through
``__torch_function__`` (``F.linear``, ``F.conv2d``, ``F.relu``, ...) and that records
its own methods (``x.flatten(1)``, ``x.size(0)``) and operators (``x + y``).

Nothing global is patched (unlike ``torch.fx.symbolic_trace``, which swaps
``nn.Module.__call__`` for every thread while it traces), so recording is safe
while other models train in the same process. A forward that branches on its
input's values or shape, makes tensors of its own, changes a weight or buffer in
place, or returns anything but one tensor cannot be recorded: ``record`` raises
:class:`Unrecordable`, and the group runs through ``vmap``.

Some modules are recorded whole, as one call (``leaves``): a BatchNorm's forward
checks its input's rank and counts its batches in a buffer, neither of which a
stand-in can replay, where its call as a whole has a batched form.

>>> calls, output = record(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU()), methods={"flatten"})
>>> [call.name for call in calls], output
(['linear', 'relu'], Ref(index=2))
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SIZE_METHODS", "Call", "Param", "Ref", "Unrecordable", "record"]


class Unrecordable(Exception):
    """The forward does something a recording cannot replay."""


@dataclass(frozen=True)
class Ref:
    """The value of the input (index 0) or of recorded call ``index - 1``."""

    index: int


@dataclass(frozen=True)
class Param:
    """One of the model's parameters or buffers, by name."""

    name: str


@dataclass(frozen=True)
class Call:
    """``target(*args, **kwargs)``: a function, or (a name) a method of ``args[0]``;
    ``args`` hold :class:`Ref` and :class:`Param` where the forward passed a value or
    a weight. ``tensor`` is False where the result is not a tensor (a size)."""

    target: Callable[..., Any] | str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    tensor: bool

    @property
    def name(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return getattr(self.target, "__name__", type(self.target).__name__)


#: methods whose result is a size or a number, not a tensor
SIZE_METHODS = frozenset({"size", "dim"})


def record(
    model: torch.nn.Module, methods: Collection[str], leaves: Callable[[torch.nn.Module], Any] = lambda module: None
) -> tuple[list[Call], Ref]:
    """The calls ``model(x)`` makes on ``x``, in order, and which value it returns.
    Of the input's attributes the forward may read only ``methods`` (and ``shape``):
    any other (``x.device``, ``x.is_cuda``) would be a stand-in's, not the input's.

    A module for which ``leaves`` gives a target (not None) is recorded as one call of
    that target: its input, and its own parameters and buffers as keyword arguments
    under their names. Its forward does not run: the module's instance holds a
    recording forward meanwhile, so record a copy that no other thread calls."""
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
            raise Unrecordable(f"{type(module).__name__} has a hook")
    recorder = _Recorder(model, frozenset(methods))
    versions = _versions(model)
    swapped = _record_whole(model, recorder, leaves)
    try:
        out = model(Symbol(recorder, Ref(0), tensor=True))
    except Unrecordable:
        raise
    except Exception as error:  # any failure means: not recordable, so vmap
        raise Unrecordable(f"{type(error).__name__}: {error}") from error
    finally:
        for module in swapped:
            delattr(module, "forward")
    changed = [name for name, version in _versions(model).items() if version != versions[name]]
    if changed:  # a change the replay would not make
        raise Unrecordable(f"the forward changes {changed[0]} in place")
    if not isinstance(out, Symbol) or not out._tensor:
        raise Unrecordable(f"the forward returns {type(out).__name__}, not one tensor")
    return recorder.calls, out._ref


def _versions(model: torch.nn.Module) -> dict[str, int]:
    """How many times each weight and buffer has changed in place."""
    return {name: t._version for name, t in (*model.named_parameters(), *model.named_buffers())}


def _record_whole(
    model: torch.nn.Module, recorder: _Recorder, leaves: Callable[[torch.nn.Module], Any]
) -> list[torch.nn.Module]:
    """Gives each module that ``leaves`` names a forward that records it as one call;
    returns those modules."""
    swapped = []
    for module in model.modules():
        target = leaves(module)
        if target is None:
            continue

        def forward(input: Any, module: torch.nn.Module = module, target: Any = target) -> Symbol:
            if not isinstance(input, Symbol):
                raise Unrecordable(f"{type(module).__name__} is called on a tensor of the forward's own")
            own = (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
            return recorder.add(target, (input,), dict(own))

        module.forward = forward  # the instance's, over its class's
        swapped.append(module)
    return swapped


class _Recorder:
    def __init__(self, model: torch.nn.Module, methods: frozenset[str]) -> None:
        self.calls: list[Call] = []
        self.methods = methods
        self._weights = {id(t): name for name, t in (*model.named_parameters(), *model.named_buffers())}

    def add(self, target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Symbol:
        stored_args, stored_kwargs = self._stored(args), {key: self._stored(v) for key, v in kwargs.items()}
        symbols = [a for a in _flat((args, kwargs)) if isinstance(a, Symbol)]
        tensor = target not in SIZE_METHODS and any(s._tensor for s in symbols)
        self.calls.append(Call(target, stored_args, stored_kwargs, tensor))
        return Symbol(self, Ref(len(self.calls)), tensor=tensor)

    def _stored(self, value: Any) -> Any:
        if isinstance(value, Symbol):
            return value._ref
        if isinstance(value, torch.Tensor):
            if id(value) not in self._weights:
                raise Unrecordable("the forward uses a tensor that is not one of the model's weights")
            return Param(self._weights[id(value)])
        if isinstance(value, (tuple, list)):
            return type(value)(self._stored(v) for v in value)
        if isinstance(value, dict):
            return {key: self._stored(v) for key, v in value.items()}
        return value


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _flat(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _flat(v)]
    return [value]


def _operator(fn: Callable[..., Any], swap: bool = False) -> Callable[..., Symbol]:
    def apply(self: Symbol, *other: Any) -> Symbol:
        return self._recorder.add(fn, (*other, self) if swap else (self, *other), {})

    return apply


def _concrete(self: Symbol, *_: Any) -> Any:
    raise Unrecordable("the forward needs a concrete value (a branch or a loop on its input)")


class Symbol:
    """Stands for a value the forward computes from its input; records what it does with it."""

    def __init__(self, recorder: _Recorder, ref: Ref, tensor: bool) -> None:
        self._recorder, self._ref, self._tensor = recorder, ref, tensor

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Symbol:
        recorder = next(a for a in _flat((args, kwargs or {})) if isinstance(a, Symbol))._recorder
        return recorder.add(func, tuple(args), dict(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._recorder.methods:
            raise Unrecordable(f"the forward reads .{name} of a tensor")
        return lambda *args, **kwargs: self._recorder.add(name, (self, *args), kwargs)

    @property
    def shape(self) -> Symbol:
        return self._recorder.add("size", (self,), {})

    __add__, __radd__ = _operator(operator.add), _operator(operator.add, swap=True)
    __sub__, __rsub__ = _operator(operator.sub), _operator(operator.sub, swap=True)
    __mul__, __rmul__ = _operator(operator.mul), _operator(operator.mul, swap=True)
    __truediv__, __rtruediv__ = _operator(operator.truediv), _operator(operator.truediv, swap=True)
    __floordiv__, __rfloordiv__ = _operator(operator.floordiv), _operator(operator.floordiv, swap=True)
    __neg__, __getitem__ = _operator(operator.neg), _operator(operator.getitem)
    __bool__ = __int__ = __index__ = __float__ = __len__ = __iter__ = _concrete
