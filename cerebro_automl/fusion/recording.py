"""The torch calls a model's forward makes on inputs of one shape, recorded once by
calling it on a stand-in for its input: a tensor-like ``Symbol`` that torch hands back
through ``__torch_function__`` (``F.linear``, ``F.conv2d``, ``F.relu``, ...) and that
records its own methods (``x.flatten(1)``, ``x.transpose(1, 2)``) and operators
(``x + y``, ``q @ k``).

A symbol carries its value's shape and dtype (a tensor on the ``meta`` device, which
holds no data), so a forward may read sizes (``b, n, d = x.shape``) and branch on them:
a recording holds for inputs of the shape and dtype it was made with, and sizes are
numbers in it. Calls that return several tensors (``unbind``, ``chunk``, ``split``)
give a symbol for each.

Nothing global is patched (unlike ``torch.fx.symbolic_trace``, which swaps
``nn.Module.__call__`` for every thread while it traces), so recording is safe
while other models train in the same process. A forward that branches on its
input's values, makes tensors of its own, changes a weight or buffer in place, or
returns anything but one tensor cannot be recorded: ``record`` raises
:class:`Unrecordable`, and the group runs through ``vmap``.

Some modules are recorded whole, as one call (``leaves``): a BatchNorm's forward
counts its batches in a buffer, which a stand-in cannot replay, where its call as a
whole has a batched form.

>>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
>>> calls, output = record(model, methods={"flatten"}, example=torch.ones(5, 3))
>>> [call.name for call in calls], output
(['linear', 'relu'], Ref(index=2))
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["Call", "Constant", "Param", "Ref", "Unrecordable", "record"]


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


@dataclass(frozen=True, eq=False)
class Constant:
    """A tensor the forward makes of its own, from numbers and sizes (``torch.arange(n)``,
    a mask of ones): the same in every replay on inputs of the recorded shape."""

    tensor: torch.Tensor


@dataclass(frozen=True)
class Call:
    """``target(*args, **kwargs)``: a function, or (a name) a method of ``args[0]``;
    ``args`` hold :class:`Ref` and :class:`Param` where the forward passed a value or
    a weight. Its value is a tensor, or (``several``) a tuple of tensors and Nones."""

    target: Callable[..., Any] | str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    several: bool = False

    @property
    def name(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return getattr(self.target, "__name__", type(self.target).__name__)


#: what a forward may read of its values besides their methods: facts of the shape and dtype
_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "is_nested"})
#: the calls that draw random numbers: a tensor of the forward's own made by one is not a constant
_RANDOM = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
    "multinomial", "poisson", "uniform_", "normal_", "random_", "exponential_", "bernoulli_", "cauchy_",
    "log_normal_", "geometric_", "dropout", "dropout_", "alpha_dropout", "feature_alpha_dropout", "dropout1d",
    "dropout2d", "dropout3d", "rrelu", "gumbel_softmax", "empty", "empty_like", "empty_strided",
})  # fmt: skip
#: the values (not tensors) a call on the stand-ins may give: facts of the shapes
_FACTS = (int, float, bool, torch.Size, torch.dtype, type(None), tuple)


def record(
    model: torch.nn.Module,
    methods: Collection[str],
    example: torch.Tensor,
    leaves: Callable[[torch.nn.Module], Any] = lambda module: None,
) -> tuple[list[Call], Ref]:
    """The calls ``model(x)`` makes on an ``x`` of ``example``'s shape, dtype and device,
    in order, and which value it returns. Of a value's tensor methods the forward may
    call only ``methods`` (and read its shape, dtype and device): any other attribute
    (``x.is_cuda``, ``x.grad``) would be a stand-in's, not the input's.

    A module for which ``leaves`` gives a target (not None) is recorded as one call of
    that target: its input, and its own parameters and buffers as keyword arguments
    under their names; its value has its input's shape. Its forward does not run: the
    module's instance holds a recording forward meanwhile, so record a copy that no
    other thread calls."""
    for module in model.modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
            raise Unrecordable(f"{type(module).__name__} has a hook")
    recorder = _Recorder(model, frozenset(methods), example)
    versions = _versions(model)
    swapped = _record_whole(model, recorder, leaves)
    try:
        with _Recording(recorder):
            out = model(Symbol(recorder, Ref(0)))
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
    if not isinstance(out, Symbol):
        raise Unrecordable(f"the forward returns {type(out).__name__}, not one tensor")
    return recorder.calls, recorder._stored(out)


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
            return recorder.add_whole(target, input, dict(own))

        module.forward = forward  # the instance's, over its class's
        swapped.append(module)
    return swapped


class _Recording(TorchFunctionMode):
    """Sees the torch calls the forward makes on its weights alone too (``self.cls_token.expand(...)``),
    which no stand-in takes part in. A mode is the calling thread's only."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not any(isinstance(a, Symbol) or self._recorder.is_weight(a) for a in _flat((args, kwargs))):
            # a tensor of the forward's own, a constant where a value meets it: never drawn at random
            # (nor uninitialized), which a replay would draw once for good
            if getattr(func, "__name__", None) in _RANDOM:
                raise Unrecordable(f"the forward makes a tensor with {func.__name__}")
            return func(*args, **kwargs)
        return self._recorder.add_torch(func, tuple(args), kwargs)


#: a tensor's operator methods, as the operators they are: (operator, whether its operands come swapped)
_OPERATORS: dict[str, tuple[Callable[..., Any], bool]] = {
    "__add__": (operator.add, False), "__radd__": (operator.add, True), "__sub__": (operator.sub, False),
    "__rsub__": (operator.sub, True), "__mul__": (operator.mul, False), "__rmul__": (operator.mul, True),
    "__truediv__": (operator.truediv, False), "__rtruediv__": (operator.truediv, True),
    "__matmul__": (operator.matmul, False), "__rmatmul__": (operator.matmul, True), "__neg__": (operator.neg, False),
    "__getitem__": (operator.getitem, False), "__eq__": (operator.eq, False), "__ne__": (operator.ne, False),
    "__lt__": (operator.lt, False), "__le__": (operator.le, False), "__gt__": (operator.gt, False),
    "__ge__": (operator.ge, False), "__and__": (operator.and_, False), "__or__": (operator.or_, False),
    "__invert__": (operator.invert, False),
}  # fmt: skip


class _Recorder:
    def __init__(self, model: torch.nn.Module, methods: frozenset[str], example: torch.Tensor) -> None:
        self.calls: list[Call] = []
        self.methods = methods
        self.device = example.device
        weights = (*model.named_parameters(), *model.named_buffers())
        self._weights = {id(t): name for name, t in weights}
        self._metas = {name: t.detach().to("meta") for name, t in weights}
        # What each value is on the meta device, by Ref index: the input's first.
        self.values: list[Any] = [torch.empty_like(example, device="meta")]
        # Values changed in place since, and those made from them before: a replay would not see the change.
        self.stale: set[int] = set()

    def add(self, target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Records ``target(*args, **kwargs)`` and gives its value's stand-in; a value
        that is not a tensor (a size, a dtype) is the value itself, not recorded."""
        stored_args, stored_kwargs = self._stored(args), {key: self._stored(v) for key, v in kwargs.items()}
        value = self._evaluate(target, stored_args, stored_kwargs)
        if isinstance(value, torch.Tensor):
            return self._append(Call(target, stored_args, stored_kwargs), value)
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            if not all(isinstance(v, (torch.Tensor, type(None))) for v in value):
                raise Unrecordable(f"{Call(target, (), {}).name} returns tensors and other values")
            whole = self._append(Call(target, stored_args, stored_kwargs, several=True), tuple(value))._ref
            return tuple(None if v is None else self._append(Call(operator.getitem, (whole, i), {}), v)
                         for i, v in enumerate(value))  # fmt: skip
        if not isinstance(value, _FACTS):  # a number of the shape stays a number
            raise Unrecordable(f"{Call(target, (), {}).name} returns {type(value).__name__}")
        return value

    def add_torch(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Records a call torch hands over: a tensor's method as its name, an operator method
        as its operator."""
        name = getattr(func, "__name__", None)
        if name is None or getattr(torch.Tensor, name, None) is not func:
            return self.add(func, args, kwargs)
        if name in _OPERATORS:
            target, swapped = _OPERATORS[name]
            return self.add(target, (args[1], args[0], *args[2:]) if swapped else args, kwargs)
        return self.add(name, args, kwargs)

    def is_weight(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and id(value) in self._weights

    def add_whole(self, target: Any, input: Symbol, weights: dict[str, torch.Tensor]) -> Symbol:
        """Records a module as one call of ``target``; its value has its input's shape."""
        call = Call(target, (input._ref,), {key: self._stored(t) for key, t in weights.items()})
        return self._append(call, self.values[input._ref.index])  # no call: the mode would record it

    def _append(self, call: Call, value: Any) -> Symbol:
        self.calls.append(call)
        self.values.append(value)
        return Symbol(self, Ref(len(self.calls)))

    def changed_in_place(self, old: Symbol, new: Symbol) -> Symbol:
        """``old`` was changed in place into ``new`` (``h += x``): ``old`` and what was made
        of it before (a view of it, maybe) may not be used any more."""
        made = {old._ref.index}
        for index, call in enumerate(self.calls[: new._ref.index - 1], start=1):
            if any(isinstance(a, Ref) and a.index in made for a in _flat((call.args, call.kwargs))):
                made.add(index)
        self.stale |= made
        return new

    def _stored(self, value: Any) -> Any:
        if isinstance(value, Symbol):
            if value._ref.index in self.stale:
                raise Unrecordable("the forward uses a value after changing it, or what it was made from, in place")
            return value._ref
        if isinstance(value, torch.Tensor):
            if id(value) in self._weights:
                return Param(self._weights[id(value)])
            if value.requires_grad:
                raise Unrecordable("the forward uses a tensor that trains and is not one of the model's weights")
            return Constant(value.detach().clone())  # as it is now: the forward may change it later
        if isinstance(value, (tuple, list)):
            return type(value)(self._stored(v) for v in value)
        if isinstance(value, dict):
            return {key: self._stored(v) for key, v in value.items()}
        return value

    def _evaluate(self, target: Callable[..., Any] | str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call on the meta device: its value's shape and dtype, or why it fails."""
        args, kwargs = self._meta(args), {key: self._meta(v) for key, v in kwargs.items()}
        try:
            if isinstance(target, str):
                return getattr(args[0], target)(*args[1:], **kwargs)
            return target(*args, **kwargs)
        except Exception as error:
            raise Unrecordable(f"{Call(target, (), {}).name}: {type(error).__name__}: {error}") from error

    def _meta(self, value: Any) -> Any:
        if isinstance(value, Ref):
            return self.values[value.index]
        if isinstance(value, Param):
            return self._metas[value.name]
        if isinstance(value, Constant):
            return value.tensor.to("meta")
        if isinstance(value, (tuple, list)):
            return type(value)(self._meta(v) for v in value)
        if isinstance(value, dict):
            return {key: self._meta(v) for key, v in value.items()}
        return value


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _flat(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _flat(v)]
    return [value]


def _operator(fn: Callable[..., Any], swap: bool = False) -> Callable[..., Any]:
    def apply(self: Symbol, *other: Any) -> Any:
        return self._recorder.add(fn, (*other, self) if swap else (self, *other), {})

    return apply


def _in_place(fn: Callable[..., Any]) -> Callable[..., Any]:
    def apply(self: Symbol, other: Any) -> Any:
        return self._recorder.changed_in_place(self, self._recorder.add(fn, (self, other), {}))

    return apply


def _concrete(self: Symbol, *_: Any) -> Any:
    raise Unrecordable("the forward needs a concrete value (a branch or a loop on its input's values)")


class Symbol:
    """Stands for a value the forward computes from its input; records what it does with
    it, and knows its shape and dtype."""

    def __init__(self, recorder: _Recorder, ref: Ref) -> None:
        self._recorder, self._ref = recorder, ref

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        recorder = next(a for a in _flat((args, kwargs or {})) if isinstance(a, Symbol))._recorder
        return recorder.add_torch(func, tuple(args), dict(kwargs or {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _ATTRIBUTES:
            return getattr(self._recorder.values[self._ref.index], name)
        if name == "device":  # the input's: a recording holds for inputs on one device
            return self._recorder.device
        if name not in self._recorder.methods:
            raise Unrecordable(f"the forward reads .{name} of a tensor")
        return lambda *args, **kwargs: self._recorder.add(name, (self, *args), kwargs)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance(x, torch.Tensor) holds, as for the input it stands for
        return torch.Tensor

    def __len__(self) -> int:
        return len(self._recorder.values[self._ref.index])

    def __iter__(self) -> Any:  # a tensor's: its rows
        return iter(self._recorder.add("unbind", (self, 0), {}))

    __add__, __radd__ = _operator(operator.add), _operator(operator.add, swap=True)
    __sub__, __rsub__ = _operator(operator.sub), _operator(operator.sub, swap=True)
    __mul__, __rmul__ = _operator(operator.mul), _operator(operator.mul, swap=True)
    __truediv__, __rtruediv__ = _operator(operator.truediv), _operator(operator.truediv, swap=True)
    __matmul__, __rmatmul__ = _operator(operator.matmul), _operator(operator.matmul, swap=True)
    __neg__, __getitem__ = _operator(operator.neg), _operator(operator.getitem)
    __eq__, __ne__ = _operator(operator.eq), _operator(operator.ne)
    __lt__, __le__, __gt__, __ge__ = (_operator(op) for op in (operator.lt, operator.le, operator.gt, operator.ge))
    __and__, __or__, __invert__ = _operator(operator.and_), _operator(operator.or_), _operator(operator.invert)
    __iadd__, __isub__ = _in_place(operator.add), _in_place(operator.sub)
    __imul__, __itruediv__ = _in_place(operator.mul), _in_place(operator.truediv)
    __hash__ = object.__hash__
    __bool__ = __int__ = __index__ = __float__ = __contains__ = _concrete
