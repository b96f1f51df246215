"""k models of one architecture as one: their weights stacked along a new first
dimension, called on one batch through ``torch.func.vmap`` (``call``), or through
batched layers where the model is built of layers that have them (``batched_forward``).

Every member computes its own forward, loss and gradients (the members' weights
are separate slices, so summing their losses gives each its own gradient), in
batched kernels: one read of the batch, one launch per layer for all members.

>>> members = [torch.nn.Linear(3, 2) for _ in range(4)]
>>> stacked = StackedModels(members)
>>> out = stacked.call(lambda model, x: model(x), torch.ones(5, 3))
>>> tuple(out.shape)
(4, 5, 2)
>>> torch.equal(stacked.batched_forward(torch.ones(5, 3)), out)
True
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.func import functional_call, stack_module_state, vmap
from torch.nn.modules.batchnorm import _BatchNorm as _TorchBatchNorm

from ..ties import tie, tied_names
from .batched import BatchedLayers
from .layouts import SHARED, Value

__all__ = ["StackedModels"]


class StackedModels:
    """The members' parameters and buffers, each a ``[k, ...]`` tensor; parameters are
    leaves that keep each member's ``requires_grad``.

    Buffers are stacked too, so a module that updates one in training (BatchNorm's
    running statistics) updates each member's own slice. A tensor a model holds under
    two names (tied weights) is stacked once, under its first name. A frozen parameter
    that every member holds as one tensor (a frozen base the worker keeps once, as LoRA
    members of one checkpoint share it) is not stacked: it stays one tensor
    (``shared``), and the batched calls run its layers once for every member, the
    members stacked along the batch.
    """

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self.k = len(models)
        self.shared = _shared_frozen(models)
        if self.shared:
            self.params, self.buffers = _stacked_except(models, self.shared)
        else:
            self.params, self.buffers = stack_module_state(models)
        for name, param in models[0].named_parameters():  # stack_module_state wants all or none
            if name not in self.shared:
                self.params[name].requires_grad_(param.requires_grad)
        # Tied names -> the name the tensor is stacked under.
        self._aliases = tied_names(models[0])
        # On the meta device: no memory for weights that functional_call replaces.
        self._base = tie(_meta_copy(models[0]), self._aliases)
        self._base.train(models[0].training)
        # the batched form of the forward on inputs of each shape and dtype met (None: vmap)
        self._layers: dict[tuple[torch.Size, torch.dtype, torch.device], BatchedLayers | None] = {}
        # The batched layers look a weight up under each of its names; they update the
        # buffers (BatchNorm's running statistics) in place, as under vmap.
        # Index buffers every member holds alike (BERT's position and token type ids) are
        # the shared batch's kin: what is made of them alone is made once for all members.
        alike = {n: Value(self.buffers[n][0], SHARED) for n in _alike_index_buffers(models)}
        stacked: dict[str, Any] = {
            **self.params,
            **self.buffers,
            **alike,
            **{n: Value(t, SHARED) for n, t in self.shared.items()},
        }
        tied = {alias: stacked[name] for alias, name in self._aliases.items() if name in stacked}
        self._layer_weights = {**stacked, **tied}

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(model, *args)`` for every member at once: ``model`` is the members' one
        module, holding member i's weights in call i; ``args`` are shared (not batched).
        Tensors ``fn`` returns come back stacked along a new first dimension."""
        wrapper = _Call(self._base, fn)

        def one(weights: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], *shared: Any) -> Any:
            # Without tied names, functional_call may skip its search for them.
            return functional_call(wrapper, {**weights, **frozen}, args=shared, tie_weights=bool(self._aliases))

        # "same": the members share the group's random draws (dropout masks), as they share
        # its data order; so a member's draws are those it would make alone with the group's
        # seed, and do not change when other members leave the group.
        batched = vmap(one, in_dims=(0, None, *([None] * len(args))), randomness="same")
        frozen = {f"model.{name}": t for name, t in self.shared.items()}
        return batched(_prefixed(self.params, self.buffers), frozen, *args)

    def batched_forward(self, x: Any) -> torch.Tensor | None:
        """``model(x)`` for every member, ``[k, ...]``, without ``vmap``: where the model is
        built of layers with a batched form (:class:`BatchedLayers`), ``x`` is one tensor
        and no autocast is on; else None, and the caller goes through :meth:`call`."""
        if not isinstance(x, torch.Tensor) or torch.is_autocast_enabled(x.device.type):
            return None
        layers = self.layers_for(x)
        return None if layers is None else layers(self._layer_weights, x)

    def layers_for(self, x: torch.Tensor) -> BatchedLayers | None:
        """The batched form of the forward on inputs of ``x``'s shape, dtype and device
        (recorded once for each), or None: the members go through ``vmap``."""
        key = (x.shape, x.dtype, x.device)
        if key not in self._layers:
            self._layers[key] = BatchedLayers.of(self._base, x)
        return self._layers[key]

    def trainable(self) -> dict[str, torch.Tensor]:
        """The stacked parameters that train (``requires_grad``)."""
        return {n: p for n, p in self.params.items() if p.requires_grad}

    @torch.no_grad()
    def member_weights(self, index: int, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Member ``index``'s entries of a state dict with ``names`` (its own copies)."""
        stacked = {**self.params, **self.buffers}
        out = {}
        for name in names:
            first = self._aliases.get(name, name)
            out[name] = (self.shared[first] if first in self.shared else stacked[first][index]).detach().clone()
        return out


class _Call(torch.nn.Module):
    """A module whose forward is ``fn(model, *args)``: ``functional_call`` swaps the
    weights of ``model`` (its submodule) while ``fn`` runs, whatever ``fn`` calls."""

    def __init__(self, model: torch.nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.model, self._fn = model, fn

    def forward(self, *args: Any) -> Any:
        return self._fn(self.model, *args)


def _meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose weights and buffers lie on the meta device, made without
    copying their data first (a frozen base may be gigabytes)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo).to("meta")


def _alike_index_buffers(models: list[torch.nn.Module]) -> list[str]:
    """The names of the integer buffers that every member holds with the same values, but
    BatchNorm's (its count of batches changes in training): a recorded forward changes
    no other buffer in place."""
    batch_norms = {name for name, m in models[0].named_modules() if isinstance(m, _TorchBatchNorm)}
    held = [dict(m.named_buffers()) for m in models]
    return [
        name
        for name, b in held[0].items()
        if not b.is_floating_point()
        and name.rpartition(".")[0] not in batch_norms
        and all(torch.equal(h[name], b) for h in held[1:])
    ]


def _shared_frozen(models: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The frozen parameters that every member holds as one tensor, by name."""
    held = [dict(m.named_parameters()) for m in models]
    return {name: p for name, p in held[0].items() if not p.requires_grad and all(h.get(name) is p for h in held[1:])}


def _stacked_except(
    models: list[torch.nn.Module], shared: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``stack_module_state`` of the parameters not in ``shared``, and of the buffers."""
    held = [dict(m.named_parameters()) for m in models]
    params = {name: torch.stack([h[name].detach() for h in held]) for name in held[0] if name not in shared}
    buffers = [dict(m.named_buffers()) for m in models]
    return params, {name: torch.stack([b[name] for b in buffers]) for name in buffers[0]}


def _prefixed(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.{name}": t for part in (params, buffers) for name, t in part.items()}
