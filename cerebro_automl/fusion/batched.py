"""k members of one model run without ``vmap``, as HFTA fuses them: the torch calls
the model's forward makes (recorded once for each shape of input, :mod:`.recording`) replayed on the members'
stacked weights, each call once for all of them.

- ``F.linear`` is one batched matrix product. Its backward writes each weight's
  gradient in the weight's own layout, where under ``vmap`` the gradient comes
  transposed and autograd copies it; together with ``vmap``'s per-op dispatch that
  was a quarter of a fused MLP's step on the CPU.
- A convolution (``F.conv1d``/``2d``/``3d``, not grouped) is on the CPU matrix
  products (:mod:`.convolution`), the channels last; on a GPU one grouped
  convolution, the members' channels side by side (``[rows, k * channels, ...]``).
  On the CPU in training, a ReLU whose one use is a convolution's input is computed as
  the convolution cuts its windows, and its backward on the convolution's gradient
  in place: no pass and no tensor of its own.
- BatchNorm (``nn.BatchNorm1d``/``2d``/``3d``, recorded as whole modules) and
  ``F.group_norm`` are one call, as HFTA fuses them: the members' channels side by
  side (``[rows, k * channels, ...]``, on the CPU channels last in memory) are
  k * channels channels, each with its own statistics, scale, shift and running
  statistics. A cumulative average (``momentum=None``) updates each member's running
  statistics by its own count of batches.
- ``F.layer_norm``, ``F.dropout``, pooling, elementwise activations, casts,
  ``flatten``, ``view``/``reshape``, ``unsqueeze``/``squeeze``, arithmetic between
  these values (a residual addition) and comparisons act on every member at once, in
  whatever layout the members are.
- The calls that name a member's dimensions (``transpose``, ``permute``, ``unbind``,
  ``chunk``, ``split``, ``cat``, ``stack``, indexing, ``gather``, ``expand``,
  ``mean``, ``softmax``, ``matmul``) are made once with the dimensions moved past the
  members' (:mod:`.dims`); ``F.scaled_dot_product_attention`` and
  ``nn.MultiheadAttention`` fold the members into the batch (:mod:`.attention`).
- ``F.embedding`` is one lookup in the members' tables as one (HFTA's): each member's
  indices offset by its table's first row.
- A weight every member holds as one tensor (a frozen base's) is a shared value:
  ``F.linear``, ``F.layer_norm`` and ``F.embedding`` use it as it is, once for every
  member, and on the shared batch once for all of them (``_ONCE``); any other call
  takes it copied k times.

The calls are recorded for each shape, dtype and device of input
(:mod:`.recording`): a forward may read sizes (``b, n, d = x.shape``) and make
tensors of numbers and sizes. Any other call (rows picked by a tensor, a tensor drawn
at random, a BatchNorm subclass with a forward of its own) has no batched form here:
``BatchedLayers.of`` gives None, and the group runs through ``vmap`` as before.
Results equal ``vmap``'s up to float rounding: a product or convolution of another
layout may sum in another order.

>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> layers = BatchedLayers.of(model, torch.ones(7, 3))
>>> params = {n: torch.stack([p] * 5) for n, p in model.named_parameters()}  # 5 members
>>> tuple(layers(params, torch.ones(7, 3)).shape)
(5, 7, 2)
>>> BatchedLayers.of(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.SyncBatchNorm(4)), torch.ones(7, 3)) is None
True
"""

from __future__ import annotations

import inspect
import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm as _TorchBatchNorm

from . import attention, dims
from .convolution import convolution_as_products
from .layouts import (
    CHANNELS,
    FRONT,
    LAST,
    SHARED,
    Value,
    aligned,
    channels,
    dropout_mask,
    front,
    member_shape,
    stacked_weight,
)
from .products import BatchedLinear
from .recording import Call, Constant, Param, Ref, Unrecordable, record

__all__ = ["BatchedLayers"]


class _Rectified(NamedTuple):
    """A ReLU of ``value`` not yet computed: its one use, a convolution on the CPU,
    rectifies the windows as it cuts them (else the convolution computes it first)."""

    value: Value


@dataclass(frozen=True)
class _BatchNorm:
    """A BatchNorm module's call, recorded whole: its settings when it was recorded."""

    training: bool
    tracked: bool  # track_running_stats
    momentum: float | None
    eps: float

    @classmethod
    def of(cls, module: nn.Module) -> _BatchNorm | None:
        """The call of a BatchNorm whose forward is torch's own; None for any other module
        (a subclass's own forward may do anything)."""
        if not isinstance(module, _TorchBatchNorm) or type(module).forward is not _TorchBatchNorm.forward:
            return None
        return cls(module.training, module.track_running_stats, module.momentum, module.eps)


class BatchedLayers:
    """A model's recorded calls on inputs of one shape, each replayed for every member at once."""

    def __init__(self, calls: list[Call], output: Ref) -> None:
        self._calls, self._output = calls, output
        self._rectified = _rectified_inputs(calls, output)

    @classmethod
    def of(cls, model: nn.Module, x: torch.Tensor) -> BatchedLayers | None:
        """The batched form of ``model`` on inputs of ``x``'s shape and dtype, or None
        where its forward has none."""
        try:
            calls, output = record(model, methods=_METHODS, example=x, leaves=_BatchNorm.of)
        except Unrecordable:
            return None
        return cls(calls, output) if all(_replayable(call) for call in calls) else None

    def __call__(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``model(x)`` for every member, ``[k, ...]``: ``params`` holds the members'
        stacked weights (``[k, ...]`` under the model's names), ``x`` is their shared batch."""
        k = next(iter(params.values())).shape[0]
        values: list[Any] = [Value(x, SHARED)]
        for call in self._calls:
            args = _resolve(call.args, values, params)
            if len(values) in self._rectified:
                values.append(_Rectified(args[0]))
                continue
            kwargs = {key: _resolve(v, values, params) for key, v in call.kwargs.items()}
            values.append(_replay(call, args, kwargs, k))
        return front(values[self._output.index], k)


def _resolve(arg: Any, values: list[Any], params: Mapping[str, torch.Tensor]) -> Any:
    """A recorded argument's value in this replay. (A module function: a closure that
    calls itself is a reference cycle, which would keep every activation until the
    garbage collector runs.)"""
    if isinstance(arg, Ref):
        return values[arg.index]
    if isinstance(arg, Param):
        return params[arg.name]
    if isinstance(arg, Constant):
        return Value(arg.tensor, SHARED)
    if isinstance(arg, (tuple, list)):
        return type(arg)(_resolve(a, values, params) for a in arg)
    return arg


# The calls that take a weight, by their signatures: the weights must be the model's own.
def _linear_signature(input: Any, weight: Any, bias: Any = None) -> None: ...
def _conv_signature(input: Any, weight: Any, bias: Any = None, stride: Any = 1, padding: Any = 0,
                    dilation: Any = 1, groups: int = 1) -> None: ...  # fmt: skip
def _layer_norm_signature(input: Any, normalized_shape: Any, weight: Any = None, bias: Any = None,
                          eps: float = 1e-5) -> None: ...  # fmt: skip
def _dropout_signature(input: Any, p: float = 0.5, training: bool = True, inplace: bool = False) -> None: ...
def _group_norm_signature(input: Any, num_groups: int, weight: Any = None, bias: Any = None,
                          eps: float = 1e-5) -> None: ...  # fmt: skip
def _embedding_signature(input: Any, weight: Any, padding_idx: int | None = None, max_norm: float | None = None,
                         norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                         sparse: bool = False) -> None: ...  # fmt: skip


_CONVOLUTIONS = {F.conv1d: 1, F.conv2d: 2, F.conv3d: 3}
_SIGNATURES: dict[Any, inspect.Signature] = {
    F.linear: inspect.signature(_linear_signature),
    **dict.fromkeys(_CONVOLUTIONS, inspect.signature(_conv_signature)),
    F.layer_norm: inspect.signature(_layer_norm_signature),
    F.dropout: inspect.signature(_dropout_signature),
    F.group_norm: inspect.signature(_group_norm_signature),
    F.embedding: inspect.signature(_embedding_signature),
}
#: the ReLUs a convolution can take over
_RECTIFIERS = {F.relu, torch.relu, "relu"}
_ELEMENTWISE = {
    F.relu, F.relu6, F.leaky_relu, F.elu, F.selu, F.celu, F.gelu, F.silu, F.mish, F.softplus, F.hardtanh,
    F.hardswish, F.hardsigmoid, F.tanh, F.sigmoid, torch.relu, torch.tanh, torch.sigmoid,
    "relu", "tanh", "sigmoid", "contiguous",
}  # fmt: skip
#: pooling: acts on each channel's trailing positions alone (the value: how many)
_POOLING = {
    F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1, F.avg_pool2d: 2, F.avg_pool3d: 3,
    F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2, F.adaptive_max_pool3d: 3, F.adaptive_avg_pool1d: 1,
    F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
}  # fmt: skip
#: + - * / and negation: by operator, or (a weight on the left) by the tensor's method the operator calls
_ARITHMETIC: dict[Any, Callable[..., Any]] = {
    **{op: op for op in (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg)},
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv,
    # comparisons and masks' logic: elementwise too
    **{op: op for op in (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.and_,
                         operator.or_, operator.invert)},
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
}  # fmt: skip
_SHAPES = {"flatten", "view", "reshape", "unsqueeze", "squeeze", torch.flatten, torch.reshape, torch.unsqueeze}
#: casts of a value to another dtype (never to another device: a recording holds for one)
_CASTS = {"to", "float", "double"}
#: the tensor methods a forward may call (and those that tell its sizes)
_METHODS = {target for target in (*_ELEMENTWISE, *_SHAPES, *_CASTS, *_ARITHMETIC) if isinstance(target, str)}
_METHODS |= dims.METHODS | {"size", "dim", "numel", "is_floating_point"}


def _rectified_inputs(calls: list[Call], output: Ref) -> set[int]:
    """The values (by :class:`Ref` index) of the ReLUs whose one use is as a
    convolution's input: their convolution rectifies them (``_Rectified``)."""
    uses: Counter[int] = Counter()

    def count(arg: Any) -> None:
        if isinstance(arg, Ref):
            uses[arg.index] += 1
        elif isinstance(arg, (tuple, list)):
            for a in arg:
                count(a)

    for call in calls:
        count((*call.args, *call.kwargs.values()))
    count(output)
    rectified = set()
    for call in calls:
        if call.target not in _CONVOLUTIONS:
            continue
        source = _SIGNATURES[call.target].bind(*call.args, **call.kwargs).arguments["input"]
        if not isinstance(source, Ref) or source.index == 0 or uses[source.index] != 1:
            continue
        relu = calls[source.index - 1]
        if relu.target not in _RECTIFIERS or not isinstance(relu.args[0], Ref):
            continue
        inplace = relu.kwargs.get("inplace", relu.args[1] if len(relu.args) > 1 else False)
        plain = set(relu.kwargs) <= {"inplace"} and len(relu.args) <= 2 and isinstance(inplace, bool)
        # in place, the ReLU also rectifies its input for that input's other uses
        if plain and (not inplace or uses[relu.args[0].index] == 1):
            rectified.add(source.index)
    return rectified


def _replayable(call: Call) -> bool:
    """Whether ``call`` has a batched form: a size, or a known call whose weights are the model's."""
    target = call.target
    if isinstance(target, _BatchNorm):
        return True  # its input and its own weights and buffers, as recorded
    if target in _SIGNATURES:
        try:
            bound = _SIGNATURES[target].bind(*call.args, **call.kwargs).arguments
        except TypeError:
            return False
        weights_in_place = all(isinstance(bound.get(name), (Param, type(None))) for name in ("weight", "bias"))
        if target is F.embedding:  # indices of a value or a buffer; max_norm would renormalize rows in place
            plain = bound.get("max_norm") is None and not bound.get("sparse", False)
            return isinstance(bound["input"], (Ref, Param)) and isinstance(bound["weight"], Param) and plain
        return isinstance(bound["input"], Ref) and weights_in_place and bound.get("groups", 1) == 1
    if target in dims.REPLAYS:
        return dims.replayable(call)
    if target is F.scaled_dot_product_attention:
        return attention.replayable(call)
    if target is F.multi_head_attention_forward:
        return attention.replayable_multi_head(call)
    params = [a for a in (*call.args, *call.kwargs.values()) if isinstance(a, Param)]
    if target in _ARITHMETIC:
        return not call.kwargs  # no alpha, no rounding_mode
    if params:
        return False
    if target in _CASTS:  # to(dtype) alone: no device, no tensor to take the dtype of
        return all(isinstance(a, (torch.dtype, bool)) for a in (*call.args[1:], *call.kwargs.values()))
    if target in _POOLING:
        return not call.kwargs.get("return_indices", False)
    return target in _ELEMENTWISE or target in _SHAPES


def _replay(call: Call, args: tuple[Any, ...], kwargs: dict[str, Any], k: int) -> Any:
    """The call for every member: a value, or (``call.several``) a tuple of them."""
    target = call.target
    if isinstance(target, _BatchNorm):
        return _batch_norm(target, args[0], k, **{key: stacked_weight(v, k) for key, v in kwargs.items()})
    if target in _SIGNATURES:
        bound = _SIGNATURES[target].bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        if isinstance(arguments.get("weight"), Value) and target in _ONCE:  # a frozen base's layer
            return _ONCE[target](k=k, **arguments)
        arguments.update({name: stacked_weight(arguments[name], k) for name in ("weight", "bias") if name in arguments})
        return _WEIGHTED[target](k=k, **arguments)
    if target in _ARITHMETIC:
        return _arithmetic(_ARITHMETIC[target], args, k)
    if target in dims.REPLAYS:
        return dims.REPLAYS[target](k, *args, **kwargs)
    if target is F.scaled_dot_product_attention:
        return attention.attention(k, *args, **kwargs)
    if target is F.multi_head_attention_forward:
        return attention.multi_head_attention(k, *args, **kwargs)
    value, rest = args[0], args[1:]
    if target in _POOLING:
        return _pool(target, _POOLING[target], value, rest, kwargs, k)
    if target in _SHAPES:
        return _reshape(target, value, rest, kwargs, k)
    if value.layout == SHARED and kwargs.get("inplace"):  # alone, each member would have a batch of its own
        kwargs = {**kwargs, "inplace": False}
    if isinstance(target, str):
        return Value(getattr(value.tensor, target)(*rest, **kwargs), value.layout)
    return Value(target(value.tensor, *rest, **kwargs), value.layout)


def _shared_linear(input: Value, weight: Value, bias: Value | torch.Tensor | None, k: int) -> Value:
    """``F.linear`` of a weight every member shares (a frozen base's): one product over the
    members' rows stacked along the batch, and on the shared batch once for all of them."""
    if not isinstance(bias, torch.Tensor):  # None, or shared too
        shift = None if bias is None else bias.tensor
        if input.layout == SHARED:
            return Value(F.linear(input.tensor, weight.tensor, shift), SHARED)
        return Value(F.linear(front(input, k), weight.tensor, shift), FRONT)
    out = F.linear(front(input, k), weight.tensor)
    return Value(out + bias.view(k, *[1] * (out.dim() - 2), -1), FRONT)


def _shared_layer_norm(
    input: Value, normalized_shape: Any, weight: Value | torch.Tensor | None, bias: Value | torch.Tensor | None,
    eps: float, k: int,
) -> Value:  # fmt: skip
    """``F.layer_norm`` with a frozen base's scale or shift: on the shared batch once for
    every member, else as any LayerNorm."""
    if input.layout == SHARED and all(w is None or isinstance(w, Value) for w in (weight, bias)):
        scale, shift = (w.tensor if isinstance(w, Value) else None for w in (weight, bias))
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return Value(F.layer_norm(input.tensor, shape, scale, shift, eps), SHARED)
    return _layer_norm(input, normalized_shape, stacked_weight(weight, k), stacked_weight(bias, k), eps, k)


def _shared_embedding(
    input: Value | torch.Tensor, weight: Value, padding_idx: int | None, max_norm: float | None, norm_type: float,
    scale_grad_by_freq: bool, sparse: bool, k: int,
) -> Value:  # fmt: skip
    """``F.embedding`` in a frozen base's table: one lookup of every member's indices, and
    of the shared batch's once for all of them."""
    shared = isinstance(input, Value) and input.layout == SHARED
    ids = input if isinstance(input, torch.Tensor) else (input.tensor if shared else front(input, k))
    out = F.embedding(ids, weight.tensor, padding_idx, None, norm_type, scale_grad_by_freq)
    return Value(out, SHARED if shared else FRONT)


def _linear(input: Value, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> Value:
    """``F.linear`` for every member: ``weight`` is ``[k, out, in]``, ``bias`` ``[k, out]``."""
    h = front(input, k)
    out_features, in_features = weight.shape[1:]
    out = BatchedLinear.apply(h.reshape(k, -1, in_features), weight, bias)
    return Value(out.view(k, *h.shape[1:-1], out_features), FRONT)


def _convolution(
    input: Value | _Rectified, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, padding: Any,
    dilation: Any, groups: int, k: int,
) -> Value:  # fmt: skip
    """One convolution for every member. On the CPU in training, matrix products (which
    rectify a ReLU's input as they cut its windows); on the shared batch, the members'
    filters side by side; else on a GPU a grouped convolution, one group per member, and
    on the CPU each member's own convolution (oneDNN's direct kernels, faster there than
    products when no backward follows)."""
    if isinstance(input, _Rectified):
        rectify, input = True, input.value
    else:
        rectify = False
    h, layout = input
    dims = weight.dim() - 3
    stride, dilation = _tuple(stride, dims), _tuple(dilation, dims)
    padding = padding if isinstance(padding, str) else _tuple(padding, dims)
    cpu = h.device.type == "cpu"
    if cpu and torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad) and _as_products(input, k):
        if layout == SHARED:
            h = h.movedim(1, -1)
        elif layout != LAST:
            h = front(input, k).movedim(2, -1)
        out = convolution_as_products(h, weight, bias, stride=stride, padding=padding, dilation=dilation,
                                      shared=layout == SHARED, rectify=rectify)  # fmt: skip
        return Value(out, LAST)
    if rectify:
        input = Value(F.relu(h), layout)
        h = input.tensor
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims]
    if cpu and layout != SHARED:
        pairs = zip(front(input, k).unbind(0), weight.unbind(0), strict=True)
        out = torch.stack([conv(x, w, None, stride, padding, dilation) for x, w in pairs])
        return Value(out if bias is None else out + bias.view(k, 1, -1, *[1] * dims), FRONT)
    if layout != SHARED:
        h = channels(front(input, k), k)
    out = conv(h, weight.flatten(0, 1), None, stride, padding, dilation, 1 if layout == SHARED else k)
    # The bias added apart, as vmap adds it: its gradient is then summed in vmap's order.
    return Value(out if bias is None else out + bias.view(-1, *[1] * (out.dim() - 2)), CHANNELS)


def _as_products(input: Value, k: int) -> bool:
    """Whether a convolution on the CPU in training is matrix products: on 1-d positions and
    on a few 2-d or 3-d ones, where they beat oneDNN's kernels; on more, each member's own
    convolution (a ResNet's first stages: at 8 members of batch 32, 16x16 positions of 32
    channels took 380 ms as products against 133 ms one by one, forward and backward)."""
    positions = member_shape(input, k)[2:]
    return len(positions) == 1 or positions.numel() <= 16


def _tuple(value: int | tuple[int, ...] | list[int], dims: int) -> tuple[int, ...]:
    return (value,) * dims if isinstance(value, int) else tuple(value)


def _layer_norm(
    input: Value, normalized_shape: Any, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, k: int
) -> Value:
    """Normalized, then each member's scale and shift applied apart, as vmap applies them."""
    h, layout = input
    if layout in (CHANNELS, LAST):  # it normalizes a member's trailing dimensions
        h, layout = front(input, k), FRONT
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    out = F.layer_norm(h, shape, None, None, eps)
    if weight is None and bias is None:
        return Value(out, layout)
    if layout == SHARED:
        out = out.expand(k, *out.shape)
    view = (k, *[1] * (out.dim() - 1 - len(shape)), *shape)
    if weight is not None:
        out = out * weight.view(view)
    return Value(out if bias is None else out + bias.view(view), FRONT)


def _dropout(input: Value, p: float, training: bool, inplace: bool, k: int) -> Value:
    h, layout = input
    if not training or p == 0:
        return input
    if layout == SHARED:  # not in place: alone, each member would have a batch of its own
        return Value(F.dropout(h, p, True, False), SHARED)
    mask = dropout_mask(member_shape(input, k), p, h)
    if layout == FRONT:
        return Value(h * mask, FRONT)
    if layout == LAST:
        return Value(h * mask.movedim(1, -1), LAST)
    member = h.unflatten(1, (k, -1))  # [rows, k, channels, ...]
    return Value((member * mask.unsqueeze(1)).flatten(1, 2), CHANNELS)


def _side_by_side(value: Value, k: int) -> torch.Tensor:
    """The members' channels side by side, ``[rows, k * channels, ...]``: the channels
    a normalization of each member's own channels takes at once."""
    h, layout = value
    if layout == CHANNELS:
        return h
    if layout == SHARED:
        return h.repeat(1, k, *[1] * (h.dim() - 2))
    if layout == LAST and h.dim() in (5, 6):
        # One copy into channels last in memory ([rows, ...positions, k * channels]), the
        # layout the CPU's normalization kernels take for 2-d and 3-d positions, and the
        # next convolution cuts its windows from as fast as from its own.
        rows_first = h.movedim(0, -2)
        return rows_first.reshape(*rows_first.shape[:-2], -1).movedim(-1, 1)
    return channels(front(value, k), k)


def _batch_norm(
    norm: _BatchNorm, input: Value, k: int, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    running_mean: torch.Tensor | None = None, running_var: torch.Tensor | None = None,
    num_batches_tracked: torch.Tensor | None = None,
) -> Value:  # fmt: skip
    """``nn.BatchNorm``'s forward for every member in one ``F.batch_norm`` (HFTA's): the
    weights and buffers are the members' stacked ones, ``[k, channels]``, read and
    updated in place as ``[k * channels]``. On the CPU with the members in front (each
    member's own convolutions), each member's own call: side by side would cost a copy
    there and another for the next convolution."""
    update = norm.training and norm.tracked
    if input.layout == FRONT and input.tensor.device.type == "cpu":
        if update and num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        weights, biases = (None if t is None else t.unbind(0) for t in (weight, bias))
        each = [F.batch_norm(x, *_member_batch_norm_arguments(norm, i, weights, biases, running_mean, running_var,
                                                              num_batches_tracked))
                for i, x in enumerate(input.tensor.unbind(0))]  # fmt: skip
        return Value(torch.stack(each), FRONT)
    h = _side_by_side(input, k)
    weight, bias = _flat(weight), _flat(bias)
    momentum = 0.0 if norm.momentum is None else norm.momentum  # torch's forward passes 0.0 without a count
    if update and num_batches_tracked is not None:
        num_batches_tracked.add_(1)
        if norm.momentum is None and running_mean is not None and running_var is not None:
            out = F.batch_norm(h, None, None, weight, bias, True, 0.0, norm.eps)
            _average_cumulatively(h, running_mean, running_var, num_batches_tracked)
            return Value(out, CHANNELS)
    batch_stats = norm.training or (running_mean is None and running_var is None)
    stats = (_flat(running_mean), _flat(running_var)) if not norm.training or norm.tracked else (None, None)
    return Value(F.batch_norm(h, *stats, weight, bias, batch_stats, momentum, norm.eps), CHANNELS)


def _member_batch_norm_arguments(
    norm: _BatchNorm, i: int, weight: Sequence[torch.Tensor] | None, bias: Sequence[torch.Tensor] | None,
    running_mean: torch.Tensor | None, running_var: torch.Tensor | None, counts: torch.Tensor | None,
) -> tuple[Any, ...]:  # fmt: skip
    """``F.batch_norm``'s arguments after the input for member ``i``, as torch's forward makes them
    (its count of batches already added to). The affine weights come unbound: one backward
    stacks their gradients, where k selections would each add a zero-filled ``[k, channels]``."""
    momentum = 0.0 if norm.momentum is None else norm.momentum
    if norm.training and norm.tracked and counts is not None and norm.momentum is None:
        momentum = 1.0 / float(counts[i])
    batch_stats = norm.training or (running_mean is None and running_var is None)
    passed = not norm.training or norm.tracked
    stats = [t[i] if passed and t is not None else None for t in (running_mean, running_var)]
    return (*stats, *[None if t is None else t[i] for t in (weight, bias)], batch_stats, momentum, norm.eps)


def _flat(weight: torch.Tensor | None) -> torch.Tensor | None:
    """The members' ``[k, channels]`` as ``[k * channels]``, a view."""
    return None if weight is None else weight.view(-1)


@torch.no_grad()
def _average_cumulatively(
    h: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, counts: torch.Tensor
) -> None:
    """``momentum=None``: each member's running statistics move by 1 / its own count
    towards the batch's (the variance unbiased, as BatchNorm keeps it)."""
    var, mean = torch.var_mean(h, dim=[d for d in range(h.dim()) if d != 1])
    factor = (1.0 / counts.double()).to(mean.dtype).unsqueeze(1)  # [k, 1]
    running_mean.lerp_(mean.view_as(running_mean), factor)
    running_var.lerp_(var.view_as(running_var), factor)


def _group_norm(
    input: Value, num_groups: int, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, k: int
) -> Value:
    """One ``F.group_norm`` for every member: k * ``num_groups`` groups of the members'
    channels side by side, each member's scale and shift with them."""
    out = F.group_norm(_side_by_side(input, k), k * num_groups, _flat(weight), _flat(bias), eps)
    return Value(out, CHANNELS)


def _embedding(
    input: Value | torch.Tensor, weight: torch.Tensor, padding_idx: int | None, max_norm: float | None,
    norm_type: float, scale_grad_by_freq: bool, sparse: bool, k: int,
) -> Value:  # fmt: skip
    """One lookup in the members' tables as one, ``[k * rows, features]`` (HFTA's): each
    member's indices offset by its table's first row. The padding row's gradient stays
    0, as ``padding_idx`` keeps it alone."""
    rows = weight.shape[1]
    ids = input if isinstance(input, torch.Tensor) else front(input, k)
    offsets = torch.arange(0, k * rows, rows, device=ids.device).view(k, *[1] * (ids.dim() - 1))
    table = weight.flatten(0, 1)
    out = F.embedding(ids + offsets, table, scale_grad_by_freq=scale_grad_by_freq)
    if padding_idx is not None:
        padding = (ids == padding_idx % rows).unsqueeze(-1)
        out = torch.where(padding, F.embedding(ids + offsets, table.detach()), out)
    return Value(out, FRONT)


#: the weighted calls with a form for a weight every member shares (a frozen base's)
_ONCE: dict[Any, Callable[..., Value]] = {
    F.linear: _shared_linear,
    F.layer_norm: _shared_layer_norm,
    F.embedding: _shared_embedding,
}
_WEIGHTED: dict[Any, Callable[..., Value]] = {
    F.linear: _linear,
    **dict.fromkeys(_CONVOLUTIONS, _convolution),
    F.layer_norm: _layer_norm,
    F.dropout: _dropout,
    F.group_norm: _group_norm,
    F.embedding: _embedding,
}


def _pool(target: Callable[..., torch.Tensor], dims: int, value: Value, rest: tuple[Any, ...],
          kwargs: dict[str, Any], k: int) -> Value:  # fmt: skip
    """Pooling acts on each channel's trailing ``dims`` positions: the members' channels
    side by side, or the members and rows as one batch."""
    h, layout = value
    if layout in (SHARED, CHANNELS):
        return Value(target(h, *rest, **kwargs), layout)
    h = front(value, k)
    out = target(h.reshape(-1, *h.shape[-1 - dims :]), *rest, **kwargs)
    return Value(out.view(*h.shape[: -1 - dims], *out.shape[1:]), FRONT)


def _reshape(target: Any, value: Value, rest: tuple[Any, ...], kwargs: dict[str, Any], k: int) -> Value:
    """flatten, view, reshape, unsqueeze, squeeze of each member's value."""
    name = target if isinstance(target, str) else target.__name__
    if value.layout == SHARED:
        return Value(getattr(value.tensor, name)(*rest, **kwargs), SHARED)
    h = front(value, k)
    if name in ("view", "reshape"):
        shape = rest[0] if len(rest) == 1 and not isinstance(rest[0], int) else rest
        shape = kwargs.get("shape", shape)
        return Value(h.reshape(k, *shape), FRONT)
    if name == "flatten":
        dims = [rest[i] if len(rest) > i else kwargs.get(key, default)
                for i, (key, default) in enumerate((("start_dim", 0), ("end_dim", -1)))]  # fmt: skip
        return Value(h.flatten(*[d + 1 if d >= 0 else d for d in dims]), FRONT)
    dim = rest[0] if rest else kwargs.get("dim")
    if dim is None:  # squeeze(): every dimension of size 1 of the member
        return Value(h.reshape(k, *[n for n in h.shape[1:] if n != 1]), FRONT)
    # unsqueeze(-1) adds a last dimension; squeeze(-1) removes it: negative dims stay as they are
    moved = (
        tuple(d + 1 if d >= 0 else d for d in dim) if isinstance(dim, (tuple, list)) else (dim + 1 if dim >= 0 else dim)
    )
    return Value(getattr(h, name)(moved), FRONT)


def _arithmetic(target: Callable[..., Any], args: tuple[Any, ...], k: int) -> Value:
    """``+ - * /`` between members' values, their weights and numbers: where the layouts
    differ, each member's operands in front, aligned at their last dimension as the
    model aligns them."""
    operands = {i: a for i, a in enumerate(args) if isinstance(a, (Value, torch.Tensor))}
    layouts = {a.layout if isinstance(a, Value) else FRONT for a in operands.values()}
    shapes = {a.tensor.shape if isinstance(a, Value) else a.shape for a in operands.values()}
    if len(layouts) == 1 and len(shapes) == 1:
        return Value(target(*[a.tensor if isinstance(a, Value) else a for a in args]), layouts.pop())
    fronts = {i: front(a, k) if isinstance(a, Value) else a for i, a in operands.items()}
    dims = max(t.dim() for t in fronts.values())
    return Value(target(*[aligned(fronts[i], dims) if i in fronts else a for i, a in enumerate(args)]), FRONT)
