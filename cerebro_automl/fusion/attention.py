"""Attention for every member at once (:mod:`.batched`): the members folded into the
batch, as HFTA fuses attention, then one call.

``F.scaled_dot_product_attention`` takes any number of batch dimensions; with the
members in front, ``[k, rows, heads, positions, features]`` is folded to
``[k * rows, heads, ...]``, the shape the fused kernels of a GPU take. A call with
dropout inside the attention has no batched form: alone, each member draws its own
mask, and the members share theirs (``vmap(randomness="same")``), which a kernel over
the folded batch does not draw.

>>> q = Value(torch.randn(2, 3, 4, 5, 8), FRONT)  # 2 members' [rows, heads, positions, features]
>>> attention(2, q, q, q).tensor.shape
torch.Size([2, 3, 4, 5, 8])
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.nn import functional as F

from .layouts import FRONT, SHARED, Value, aligned, front
from .recording import Call

__all__ = ["attention", "replayable"]


def _signature(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> None: ...  # fmt: skip


_SIGNATURE = inspect.signature(_signature)


def replayable(call: Call) -> bool:
    """Whether a recorded ``F.scaled_dot_product_attention`` has a batched form: no
    dropout inside it, no grouped-query heads."""
    try:
        bound = _SIGNATURE.bind(*call.args, **call.kwargs).arguments
    except TypeError:
        return False
    return bound.get("dropout_p", 0.0) == 0.0 and not bound.get("enable_gqa", False)


def attention(k: int, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Value:  # fmt: skip
    """``F.scaled_dot_product_attention`` for every member; a weight among its operands
    (a learned mask) is the members' stacked one."""
    if all(isinstance(o, Value) and o.layout == SHARED for o in (query, key, value)) and (
        attn_mask is None or (isinstance(attn_mask, Value) and attn_mask.layout == SHARED)
    ):
        mask = None if attn_mask is None else attn_mask.tensor
        out = F.scaled_dot_product_attention(
            query.tensor, key.tensor, value.tensor, mask, is_causal=is_causal, scale=scale
        )
        return Value(out, SHARED)
    q, k_, v = (o if isinstance(o, torch.Tensor) else front(o, k) for o in (query, key, value))
    dims = max(q.dim(), k_.dim(), v.dim())
    q, k_, v = (aligned(t, dims) for t in (q, k_, v))
    mask = attn_mask
    if isinstance(mask, Value):
        mask = mask.tensor if mask.layout == SHARED else aligned(front(mask, k), dims)
    elif isinstance(mask, torch.Tensor):  # the members' own
        mask = aligned(mask, dims)
    same = q.shape[:-2] == k_.shape[:-2] == v.shape[:-2]
    # a shared mask of a member's heads and positions broadcasts over the folded rows too
    if dims == 5 and same and (mask is None or mask.dim() <= 3):
        # [k, rows, heads, positions, features] as [k * rows, ...]: the shape fused kernels take
        folded = F.scaled_dot_product_attention(q.flatten(0, 1), k_.flatten(0, 1), v.flatten(0, 1),
                                                mask, is_causal=is_causal, scale=scale)  # fmt: skip
        return Value(folded.unflatten(0, (k, -1)), FRONT)
    return Value(F.scaled_dot_product_attention(q, k_, v, mask, is_causal=is_causal, scale=scale), FRONT)
