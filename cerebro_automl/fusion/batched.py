"""k members of a model built only from layers with a known batched form, run
without ``vmap``, as HFTA fuses them: an ``nn.Sequential`` (nested or not) of
``Linear``, ``Conv1d``/``Conv2d``/``Conv3d``, max and average pooling, ``LayerNorm``,
elementwise activations, ``Dropout``, ``Flatten`` and ``Identity``.

- Each ``Linear`` is one batched matrix product for all members. Its backward
  writes each weight's gradient in the weight's own layout, where under ``vmap``
  the gradient comes transposed and autograd copies it; together with ``vmap``'s
  per-op dispatch that was a quarter of a fused MLP's step on the CPU.
- Each convolution is one grouped convolution, the members' channels side by side
  (``[rows, k * channels, ...]``); activations and pooling keep that layout, so
  consecutive convolutions need no copies between them.

The results are the bits ``vmap`` gives (the same kernels on the same values).
A model with any other layer, a hook, or a subclass of these layers (which may
override ``forward``) has no batched form: ``BatchedLayers.of`` gives None, and
the group runs through ``vmap`` as before.

>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> layers = BatchedLayers.of(model)
>>> params = {n: torch.stack([p] * 5) for n, p in model.named_parameters()}  # 5 members
>>> tuple(layers(params, torch.ones(7, 3)).shape)
(5, 7, 2)
>>> BatchedLayers.of(torch.nn.Sequential(torch.nn.BatchNorm1d(3))) is None
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["BatchedLayers"]

#: layers whose forward acts on each element alone: any layout of the members will do
_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Identity,
)  # fmt: skip
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: layers that act on each channel alone: the members' channels side by side will do
_PER_CHANNEL = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
)  # fmt: skip

# Where the members are in an activation: not at all (the shared batch, ``[rows, ...]``),
# in front (``[k, rows, ...]``), or side by side in the channels (``[rows, k * channels, ...]``).
_SHARED, _FRONT, _CHANNELS = "shared", "front", "channels"


class BatchedLayers:
    """The layers of one model, in call order, each run for every member at once."""

    def __init__(self, layers: list[tuple[str, nn.Module]]) -> None:
        self._layers = layers

    @classmethod
    def of(cls, model: nn.Module) -> BatchedLayers | None:
        """The batched form of ``model``, or None where a layer has none."""
        layers: list[tuple[str, nn.Module]] = []
        return cls(layers) if _collect(model, "", layers) else None

    def __call__(self, params: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``model(x)`` for every member, ``[k, ...]``: ``params`` holds the members'
        stacked weights (``[k, ...]`` under the model's names), ``x`` is their shared batch."""
        k = next(iter(params.values())).shape[0]
        h, layout = x, _SHARED
        for prefix, layer in self._layers:
            if type(layer) is nn.Linear:
                h, layout = _linear(_front(h, layout, k), *_weights(params, prefix)), _FRONT
            elif type(layer) in _CONVOLUTIONS:
                h, layout = _convolution(h, layout, k, layer, *_weights(params, prefix))
            elif type(layer) is nn.LayerNorm:
                if layout == _CHANNELS:  # it normalizes a member's trailing dimensions
                    h, layout = _front(h, layout, k), _FRONT
                h, layout = _layer_norm(h, layout, layer, params, prefix)
            elif type(layer) is nn.Dropout:
                h = _dropout(h, layout, k, layer)
            elif type(layer) is nn.Flatten:
                h, layout = _flatten(_front(h, layout, k) if layout == _CHANNELS else h, layout, layer)
            elif type(layer) in _PER_CHANNEL and layout == _FRONT:
                h, layout = layer(_channels(h, k)), _CHANNELS
            else:
                h = layer(h)
        return _front(h, layout, k)


def _weights(params: Mapping[str, torch.Tensor], prefix: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    return params[prefix + "weight"], params.get(prefix + "bias")


def _collect(module: nn.Module, prefix: str, layers: list[tuple[str, nn.Module]]) -> bool:
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return False
    kind = type(module)
    if kind is nn.Sequential:
        return all(_collect(child, f"{prefix}{name}.", layers) for name, child in module.named_children())
    if kind in _CONVOLUTIONS:
        conv: Any = module
        if conv.groups != 1 or conv.padding_mode != "zeros":
            return False
    elif kind in _PER_CHANNEL:
        if getattr(module, "return_indices", False):
            return False
    elif kind not in (nn.Linear, nn.LayerNorm, nn.Dropout, nn.Flatten, *_ELEMENTWISE):
        return False
    layers.append((prefix, module))
    return True


def _front(h: torch.Tensor, layout: str, k: int) -> torch.Tensor:
    """``h`` as ``[k, rows, ...]``."""
    if layout == _SHARED:
        return h.expand(k, *h.shape)
    if layout == _CHANNELS:
        return h.unflatten(1, (k, -1)).transpose(0, 1)
    return h


def _channels(h: torch.Tensor, k: int) -> torch.Tensor:
    """``[k, rows, channels, ...]`` as ``[rows, k * channels, ...]``."""
    return h.transpose(0, 1).flatten(1, 2)


def _convolution(
    h: torch.Tensor, layout: str, k: int, conv: Any, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, str]:
    """One convolution for every member: on the shared batch, the members' filters
    side by side; else a grouped convolution, one group per member."""
    functional = {nn.Conv1d: nn.functional.conv1d, nn.Conv2d: nn.functional.conv2d, nn.Conv3d: nn.functional.conv3d}
    groups = 1 if layout == _SHARED else k
    if layout == _FRONT:
        h = _channels(h, k)
    out = functional[type(conv)](h, weight.flatten(0, 1), None, conv.stride, conv.padding, conv.dilation, groups)
    # The bias added apart, as vmap adds it: its gradient is then summed in vmap's order.
    return out if bias is None else out + bias.view(-1, *[1] * (out.dim() - 2)), _CHANNELS


def _layer_norm(
    h: torch.Tensor, layout: str, layer: nn.LayerNorm, params: Mapping[str, torch.Tensor], prefix: str
) -> tuple[torch.Tensor, str]:
    """``h`` (shared, or members in front) normalized, then each member's scale and shift
    applied apart, as vmap applies them."""
    out = nn.functional.layer_norm(h, layer.normalized_shape, None, None, layer.eps)
    if not layer.elementwise_affine:
        return out, layout
    weight, bias = _weights(params, prefix)
    k, dims = weight.shape[0], len(layer.normalized_shape)
    if layout == _SHARED:
        out = out.expand(k, *out.shape)
    shape = (k, *[1] * (out.dim() - 1 - dims), *layer.normalized_shape)
    out = out * weight.view(shape)
    return (out if bias is None else out + bias.view(shape)), _FRONT


def _flatten(h: torch.Tensor, layout: str, layer: nn.Flatten) -> tuple[torch.Tensor, str]:
    if layout == _SHARED:
        return layer(h), _SHARED
    shifted = [dim + 1 if dim >= 0 else dim for dim in (layer.start_dim, layer.end_dim)]
    return h.flatten(*shifted), _FRONT


def _dropout(h: torch.Tensor, layout: str, k: int, layer: nn.Dropout) -> torch.Tensor:
    if not layer.training or layer.p == 0:
        return h
    if layout == _SHARED:
        return nn.functional.dropout(h, layer.p, True, layer.inplace)
    # One mask of a member's shape for all of them: the draws vmap(randomness="same") makes.
    if layout == _FRONT:
        return h * _mask(h.shape[1:], layer.p, h)
    member = h.unflatten(1, (k, -1))  # [rows, k, channels, ...]
    return (member * _mask(member.shape[:1] + member.shape[2:], layer.p, h).unsqueeze(1)).flatten(1, 2)


def _mask(shape: torch.Size, p: float, like: torch.Tensor) -> torch.Tensor:
    return nn.functional.dropout(torch.ones(shape, dtype=like.dtype, device=like.device), p, True)


def _linear(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for every member: ``h`` is ``[k, ..., in]``, ``weight`` ``[k, out, in]``,
    ``bias`` ``[k, out]``."""
    k, out_features, in_features = weight.shape
    out = _BatchedLinear.apply(h.reshape(k, -1, in_features), weight, bias)
    return out.view(k, *h.shape[1:-1], out_features)


class _BatchedLinear(torch.autograd.Function):
    """``x @ weight^T + bias`` for every member, with a backward that gives ``weight``'s gradient
    as ``grad^T @ x``: ``[k, out, in]``, the weight's own layout, so autograd keeps it
    as it is instead of copying it into that layout."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = torch.bmm(x, weight.transpose(1, 2))
        # The bias added after the product, as vmap adds it (baddbmm rounds otherwise).
        return out if bias is None else out + bias.unsqueeze(1)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        x, weight, _ = inputs
        ctx.save_for_backward(x, weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(1) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias
