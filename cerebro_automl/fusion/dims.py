"""Calls that name a member's dimensions (``transpose``, ``permute``, ``unbind``,
``chunk``, ``split``, ``cat``, ``stack``, indexing, ``gather``, ``expand``, ``mean``,
``sum``, ``softmax``, ``matmul``), replayed for every member at once (:mod:`.batched`).

A call on the shared batch is the model's own call: every member computes it alike.
Any other value is taken with the members in front (``[k, ...]``), where a member's
dimension ``d`` is the value's ``d + 1``: the call is made once with its dimensions
moved by one. A weight (``[k, ...]``, stacked) is a value with the members in front.

>>> x = Value(torch.zeros(3, 5, 4, 2), FRONT)  # 3 members' [5, 4, 2]
>>> REPLAYS["transpose"](3, x, 0, -1).tensor.shape
torch.Size([3, 2, 4, 5])
>>> [v.tensor.shape for v in REPLAYS["unbind"](3, x, 2)]
[torch.Size([3, 5, 4]), torch.Size([3, 5, 4])]
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
from torch.nn import functional as F

from .layouts import FRONT, SHARED, Value, aligned, front, member_dim
from .recording import Call, Param, Ref

__all__ = ["METHODS", "REPLAYS", "replayable"]


def _fronted(value: Value | torch.Tensor, k: int) -> torch.Tensor:
    """A value, or a stacked weight, with the members in front."""
    return value if isinstance(value, torch.Tensor) else front(value, k)


def _shared(value: Any) -> TypeGuard[Value]:
    return isinstance(value, Value) and value.layout == SHARED


def _dims(dims: Sequence[int], ndim: int) -> tuple[int, ...]:
    return tuple(member_dim(d, ndim) for d in dims)


def _transpose(k: int, input: Value | torch.Tensor, dim0: int, dim1: int) -> Value:
    if _shared(input):
        return Value(input.tensor.transpose(dim0, dim1), SHARED)
    h = _fronted(input, k)
    return Value(h.transpose(*_dims((dim0, dim1), h.dim() - 1)), FRONT)


def _permute(k: int, input: Value | torch.Tensor, *dims: Any) -> Value:
    order = tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims
    if _shared(input):
        return Value(input.tensor.permute(order), SHARED)
    h = _fronted(input, k)
    return Value(h.permute(0, *_dims(order, h.dim() - 1)), FRONT)


def _pieces(cut: Callable[[torch.Tensor, int], Sequence[torch.Tensor]], input: Value | torch.Tensor, dim: int,
            k: int) -> tuple[Value, ...]:  # fmt: skip
    if _shared(input):
        return tuple(Value(t, SHARED) for t in cut(input.tensor, dim))
    h = _fronted(input, k)
    return tuple(Value(t, FRONT) for t in cut(h, member_dim(dim, h.dim() - 1)))


def _unbind(k: int, input: Value | torch.Tensor, dim: int = 0) -> tuple[Value, ...]:
    return _pieces(torch.unbind, input, dim, k)


def _chunk(k: int, input: Value | torch.Tensor, chunks: int, dim: int = 0) -> tuple[Value, ...]:
    return _pieces(lambda h, d: torch.chunk(h, chunks, d), input, dim, k)


def _split(k: int, input: Value | torch.Tensor, split_size_or_sections: Any = None, dim: int = 0,
           split_size: Any = None) -> tuple[Value, ...]:  # fmt: skip
    sizes = split_size if split_size_or_sections is None else split_size_or_sections
    return _pieces(lambda h, d: torch.split(h, sizes, d), input, dim, k)


def _joined(join: Callable[..., torch.Tensor], new_dim: bool) -> Callable[..., Value]:
    """``torch.cat`` (``new_dim`` False) or ``torch.stack`` of members' values."""

    def replay(k: int, tensors: Sequence[Value | torch.Tensor], dim: int = 0, axis: int | None = None) -> Value:
        dim = dim if axis is None else axis
        shared = [t.tensor for t in tensors if _shared(t)]
        if len(shared) == len(tensors):
            return Value(join(shared, dim), SHARED)
        fronts = [_fronted(t, k) for t in tensors]
        dims = fronts[0].dim() - 1 + new_dim
        return Value(join(fronts, member_dim(dim, dims)), FRONT)

    return replay


def _getitem(k: int, value: Any, index: Any) -> Any:
    if isinstance(value, tuple) and not isinstance(value, Value):  # one of a call's several values
        return value[index]
    if _shared(value):
        return Value(value.tensor[index], SHARED)
    h = _fronted(value, k)
    return Value(h[(slice(None), *(index if isinstance(index, tuple) else (index,)))], FRONT)


def _expand(k: int, input: Value | torch.Tensor, *sizes: Any) -> Value:
    sizes = tuple(sizes[0]) if len(sizes) == 1 and not isinstance(sizes[0], int) else sizes
    if _shared(input):
        return Value(input.tensor.expand(*sizes), SHARED)
    h = _fronted(input, k)
    return Value(aligned(h, len(sizes) + 1).expand(k, *sizes), FRONT)


def _reduction(name: str) -> Callable[..., Value]:
    """``mean`` or ``sum`` over a member's dimensions (all of them without ``dim``)."""

    def replay(k: int, input: Value | torch.Tensor, dim: Any = None, keepdim: bool = False, *,
               dtype: torch.dtype | None = None) -> Value:  # fmt: skip
        if _shared(input):
            return Value(getattr(input.tensor, name)(dim=dim, keepdim=keepdim, dtype=dtype), SHARED)
        h = _fronted(input, k)
        dims = tuple(range(1, h.dim())) if dim is None else _dims((dim,) if isinstance(dim, int) else dim, h.dim() - 1)
        return Value(getattr(h, name)(dims, keepdim=keepdim, dtype=dtype), FRONT)

    return replay


def _softmax(name: str) -> Callable[..., Value]:
    """``softmax`` or ``log_softmax`` along a member's dimension."""

    def replay(k: int, input: Value | torch.Tensor, dim: int, _stacklevel: int = 3, *,
               dtype: torch.dtype | None = None) -> Value:  # fmt: skip
        if _shared(input):
            return Value(getattr(input.tensor, name)(dim, dtype=dtype), SHARED)
        h = _fronted(input, k)
        return Value(getattr(h, name)(member_dim(dim, h.dim() - 1), dtype=dtype), FRONT)

    return replay


def _matmul(k: int, input: Value | torch.Tensor, other: Value | torch.Tensor) -> Value:
    """``input @ other`` for every member: the members' batch dimensions aligned at the
    right, as matmul broadcasts a model's; a vector a matrix of one row or column."""
    if _shared(input) and _shared(other):
        return Value(input.tensor @ other.tensor, SHARED)
    a, b = _fronted(input, k), _fronted(other, k)
    row, column = a.dim() == 2, b.dim() == 2  # a member's vector
    a, b = a.unsqueeze(-2) if row else a, b.unsqueeze(-1) if column else b
    dims = max(a.dim(), b.dim())
    out = aligned(a, dims) @ aligned(b, dims)
    out = out.squeeze(-2) if row else out
    return Value(out.squeeze(-1) if column else out, FRONT)


def _gather(k: int, input: Value | torch.Tensor, dim: int, index: Value | torch.Tensor, *,
            sparse_grad: bool = False) -> Value:  # fmt: skip
    if _shared(input) and _shared(index):
        return Value(torch.gather(input.tensor, dim, index.tensor, sparse_grad=sparse_grad), SHARED)
    h, picked = _fronted(input, k), _fronted(index, k)
    return Value(torch.gather(h, member_dim(dim, h.dim() - 1), picked, sparse_grad=sparse_grad), FRONT)


_MEAN, _SUM = _reduction("mean"), _reduction("sum")
_SOFTMAX, _LOG_SOFTMAX = _softmax("softmax"), _softmax("log_softmax")
_REDUCTIONS, _SOFTMAXES = (_MEAN, _SUM), (_SOFTMAX, _LOG_SOFTMAX)


def _argument(call: Call, position: int, name: str, default: Any) -> Any:
    return call.args[position] if len(call.args) > position else call.kwargs.get(name, default)


#: each target's replay: ``replay(k, *args, **kwargs)``, the values and weights in place of the recorded ones
REPLAYS: dict[Any, Callable[..., Any]] = {
    **dict.fromkeys(("transpose", torch.transpose, "swapaxes", torch.swapaxes), _transpose),
    **dict.fromkeys(("permute", torch.permute), _permute),
    **dict.fromkeys(("unbind", torch.unbind), _unbind),
    **dict.fromkeys(("chunk", torch.chunk), _chunk),
    **dict.fromkeys(("split", torch.split), _split),
    **dict.fromkeys((torch.cat, torch.concat, torch.concatenate), _joined(torch.cat, new_dim=False)),
    torch.stack: _joined(torch.stack, new_dim=True),
    operator.getitem: _getitem,
    "expand": _expand,
    **dict.fromkeys(("mean", torch.mean), _MEAN),
    **dict.fromkeys(("sum", torch.sum), _SUM),
    **dict.fromkeys(("softmax", torch.softmax, F.softmax), _SOFTMAX),
    **dict.fromkeys(("log_softmax", torch.log_softmax, F.log_softmax), _LOG_SOFTMAX),
    **dict.fromkeys((operator.matmul, torch.matmul, "matmul"), _matmul),
    **dict.fromkeys(("gather", torch.gather), _gather),
}
#: the tensor methods among them
METHODS = frozenset(target for target in REPLAYS if isinstance(target, str))


def replayable(call: Call) -> bool:
    """Whether the recorded ``call`` (its target in :data:`REPLAYS`) replays: its dimensions
    and sizes are numbers (no value picks rows or sizes), and nothing is written to ``out``."""
    if "out" in call.kwargs:
        return False
    if REPLAYS[call.target] in _REDUCTIONS and _argument(call, 1, "dim", None) == ():
        return False  # torch reads an empty tuple as every dimension, another member's too
    if REPLAYS[call.target] in _SOFTMAXES and _argument(call, 1, "dim", None) is None:
        return False  # torch's implicit choice of dimension, from the value's rank
    if call.target is operator.getitem:
        index = call.args[1]
        return all(isinstance(i, (int, slice, type(None), type(Ellipsis))) and not isinstance(i, bool)
                   for i in (index if isinstance(index, tuple) else (index,)))  # fmt: skip
    if REPLAYS[call.target] is _gather:  # the values picked by a value
        return not any(isinstance(a, (Ref, Param)) for a in (*call.args[1:2], call.kwargs.get("dim")))
    operands = 2 if REPLAYS[call.target] is _matmul else 1  # cat and stack take theirs in one list
    return not any(isinstance(a, (Ref, Param)) for a in (*call.args[operands:], *call.kwargs.values()))
