"""Where the k members are in a value the batched calls compute (:mod:`.batched`).

- ``SHARED``: not at all, the shared batch ``[rows, ...]`` every member sees alike;
- ``FRONT``: in front, ``[k, rows, ...]``;
- ``CHANNELS``: side by side in the channels, ``[rows, k * channels, ...]``;
- ``LAST``: in front with the channels last, ``[k, rows, ...positions, channels]``.

>>> h = torch.arange(12.0).view(2, 6)  # 2 rows of 3 members' 2 channels side by side
>>> front(Value(h, CHANNELS), 3).shape, member_shape(Value(h, CHANNELS), 3)
(torch.Size([3, 2, 2]), torch.Size([2, 2]))
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

__all__ = [
    "CHANNELS", "FRONT", "LAST", "SHARED", "Value", "aligned", "channels", "dropout_mask", "front", "member_dim",
    "member_shape", "stacked_weight",
]  # fmt: skip

SHARED, FRONT, CHANNELS, LAST = "shared", "front", "channels", "last"


class Value(NamedTuple):
    """A tensor every member computes, and where the members are in it."""

    tensor: torch.Tensor
    layout: str


def front(value: Value, k: int) -> torch.Tensor:
    """The value as ``[k, rows, ...]``."""
    h, layout = value
    if layout == SHARED:
        return h.expand(k, *h.shape)
    if layout == CHANNELS:
        return h.unflatten(1, (k, -1)).transpose(0, 1)
    if layout == LAST:
        return h.movedim(-1, 2)
    return h


def member_shape(value: Value, k: int) -> torch.Size:
    """The shape of one member's value: what the model sees."""
    h, layout = value
    if layout == SHARED:
        return h.shape
    if layout == CHANNELS:
        return torch.Size((h.shape[0], h.shape[1] // k, *h.shape[2:]))
    if layout == LAST:
        return torch.Size((h.shape[1], h.shape[-1], *h.shape[2:-1]))
    return h.shape[1:]


def member_dim(dim: int, dims: int) -> int:
    """A member's dimension ``dim`` (of ``dims``) in its value with the members in front."""
    if not -dims <= dim < dims:
        raise IndexError(f"dimension {dim} of a {dims}-dimensional value")
    return dim % dims + 1


def channels(h: torch.Tensor, k: int) -> torch.Tensor:
    """``[k, rows, channels, ...]`` as ``[rows, k * channels, ...]``."""
    return h.transpose(0, 1).flatten(1, 2)


def aligned(h: torch.Tensor, dims: int) -> torch.Tensor:
    """``[k, ...]`` with size-1 dimensions after the members' until it has ``dims``."""
    return h.view(h.shape[0], *[1] * (dims - h.dim()), *h.shape[1:])


def dropout_mask(shape: torch.Size, p: float, like: torch.Tensor) -> torch.Tensor:
    """One dropout mask of a member's ``shape`` for all of them, drawn in that shape's
    order, so the same whichever members the group holds. (Alone, a member draws its mask
    in its value's memory order, which a transposed value changes: the draws are alike in
    distribution, not one by one.)"""
    return F.dropout(torch.ones(shape, dtype=like.dtype, device=like.device), p, True)


def stacked_weight(weight: Any, k: int) -> Any:
    """A weight as the members' stacked ones, ``[k, ...]``: a shared one (a frozen base's,
    one tensor for every member, :class:`Value` ``SHARED``) copied k times for a call that
    has no form for it; a stacked one (or None) as it is."""
    if isinstance(weight, Value):
        return weight.tensor.expand(k, *weight.tensor.shape).contiguous()
    return weight
