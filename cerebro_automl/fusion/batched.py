"""k members of a model built only from layers with a known batched form, run
without ``vmap``: an ``nn.Sequential`` (nested or not) of ``Linear``, elementwise
activations, ``Dropout``, ``Flatten`` and ``Identity``, as HFTA fuses such layers.

Each ``Linear`` is one batched matrix product for all members. Its backward
writes each weight's gradient in the weight's own layout, where under ``vmap``
the gradient comes transposed and autograd copies it; together with ``vmap``'s
per-op dispatch that was a quarter of a fused MLP's step on the CPU. The results
are the same bits as ``vmap``'s (the same products, summed in the same order).

A model with any other layer, a hook, or a subclass of these layers (which may
override ``forward``) has no batched form: ``BatchedLayers.of`` gives None, and the
group runs through ``vmap`` as before.

>>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> layers = BatchedLayers.of(model)
>>> params = {n: torch.stack([p] * 5) for n, p in model.named_parameters()}  # 5 members
>>> tuple(layers(params, torch.ones(7, 3)).shape)
(5, 7, 2)
>>> BatchedLayers.of(torch.nn.Conv1d(1, 2, 3)) is None
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["BatchedLayers"]

#: layers whose forward acts on each element alone: a leading member dimension changes nothing
_ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Tanh, nn.Sigmoid, nn.Softplus, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Identity,
)  # fmt: skip


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
        h, stacked = x, False  # ``stacked``: h has the members' dimension in front
        for prefix, layer in self._layers:
            if type(layer) is nn.Linear:
                h, stacked = _linear(h, stacked, params[prefix + "weight"], params.get(prefix + "bias")), True
            elif type(layer) is nn.Dropout:
                h = _dropout(h, stacked, layer)
            elif type(layer) is nn.Flatten:
                h = h.flatten(_shifted(layer.start_dim, stacked), _shifted(layer.end_dim, stacked))
            else:
                h = layer(h)
        return h if stacked else h.expand(k, *h.shape)


def _collect(module: nn.Module, prefix: str, layers: list[tuple[str, nn.Module]]) -> bool:
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return False
    if type(module) is nn.Sequential:
        return all(_collect(child, f"{prefix}{name}.", layers) for name, child in module.named_children())
    if type(module) in (nn.Linear, nn.Dropout, nn.Flatten, *_ELEMENTWISE):
        layers.append((prefix, module))
        return True
    return False


def _shifted(dim: int, stacked: bool) -> int:
    return dim + 1 if stacked and dim >= 0 else dim


def _dropout(h: torch.Tensor, stacked: bool, layer: nn.Dropout) -> torch.Tensor:
    if not layer.training or layer.p == 0:
        return h
    if not stacked:
        return nn.functional.dropout(h, layer.p, True, layer.inplace)
    # One mask of a member's shape for all of them: the draws vmap(randomness="same") makes.
    return h * nn.functional.dropout(torch.ones(h.shape[1:], dtype=h.dtype, device=h.device), layer.p, True)


def _linear(h: torch.Tensor, stacked: bool, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for every member: ``h`` is ``[k, ..., in]`` (or shared ``[..., in]``),
    ``weight`` ``[k, out, in]``, ``bias`` ``[k, out]``."""
    k, out_features, in_features = weight.shape
    rows = h.shape[1:-1] if stacked else h.shape[:-1]
    flat = h.reshape(k, -1, in_features) if stacked else h.reshape(-1, in_features).expand(k, -1, -1)
    out = _BatchedLinear.apply(flat, weight, bias)
    return out.view(k, *rows, out_features)


class _BatchedLinear(torch.autograd.Function):
    """``baddbmm(bias, x, weight^T)`` with a backward that gives ``weight``'s gradient
    as ``grad^T @ x``: ``[k, out, in]``, the weight's own layout, so autograd keeps it
    as it is instead of copying it into that layout."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))

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
