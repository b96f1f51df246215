"""Attention for every member at once (:mod:`.batched`): the members folded into the
batch, as HFTA fuses attention, then one call.

``nn.MultiheadAttention`` (``F.multi_head_attention_forward``, which it calls) is its
projections as batched products and one attention call; with ``need_weights`` (its
default) or dropout in training, the weights are computed as torch computes them, a
softmax of the scaled products, and dropped with one mask for every member.

``F.scaled_dot_product_attention`` takes any number of batch dimensions; with the
members in front, ``[k, rows, heads, positions, features]`` is folded to
``[k * rows, heads, ...]``, the shape the fused kernels of a GPU take. With dropout
inside the attention (BERT's, in training), the members share one mask of a member's
attention weights, as they share every dropout mask in a group
(``vmap(randomness="same")``), which a kernel over the folded batch would not draw: the
attention is then computed as torch's reference computes it, a softmax of the scaled
products, masked.

>>> q = Value(torch.randn(2, 3, 4, 5, 8), FRONT)  # 2 members' [rows, heads, positions, features]
>>> attention(2, q, q, q).tensor.shape
torch.Size([2, 3, 4, 5, 8])
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch.nn import functional as F

from .layouts import FRONT, SHARED, Value, aligned, dropout_mask, front, member_shape, stacked_weight
from .products import BatchedLinear
from .recording import Call, Param

__all__ = ["attention", "multi_head_attention", "replayable", "replayable_multi_head"]


def _signature(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> None: ...  # fmt: skip


_SIGNATURE = inspect.signature(_signature)


def replayable(call: Call) -> bool:
    """Whether a recorded ``F.scaled_dot_product_attention`` has a batched form: no
    grouped-query heads."""
    try:
        bound = _SIGNATURE.bind(*call.args, **call.kwargs).arguments
    except TypeError:
        return False
    return not bound.get("enable_gqa", False)


def attention(k: int, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Value:  # fmt: skip
    """``F.scaled_dot_product_attention`` for every member; a weight among its operands
    (a learned mask) is the members' stacked one."""
    shared_mask = attn_mask is None or (isinstance(attn_mask, Value) and attn_mask.layout == SHARED)
    if (
        dropout_p == 0.0
        and shared_mask
        and all(isinstance(o, Value) and o.layout == SHARED for o in (query, key, value))
    ):
        # every member computes it alike (with dropout each draws the group's mask: below)
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
    if dropout_p > 0.0:
        return Value(_attention_with_dropout(q, k_, v, mask, dropout_p, is_causal, scale, k), FRONT)
    same = q.shape[:-2] == k_.shape[:-2] == v.shape[:-2]
    # a shared mask of a member's heads and positions broadcasts over the folded rows too
    if dims == 5 and same and (mask is None or mask.dim() <= 3):
        # [k, rows, heads, positions, features] as [k * rows, ...]: the shape fused kernels take
        folded = F.scaled_dot_product_attention(q.flatten(0, 1), k_.flatten(0, 1), v.flatten(0, 1),
                                                mask, is_causal=is_causal, scale=scale)  # fmt: skip
        return Value(folded.unflatten(0, (k, -1)), FRONT)
    return Value(F.scaled_dot_product_attention(q, k_, v, mask, is_causal=is_causal, scale=scale), FRONT)


def _attention_with_dropout(
    q: torch.Tensor, k_: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, p: float, is_causal: bool,
    scale: float | None, k: int,
) -> torch.Tensor:  # fmt: skip
    """Attention as torch's reference computes it, the weights dropped with one mask of a
    member's shape for all the members."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k_.transpose(-2, -1)) * scale
    if is_causal:
        length, keys = scores.shape[-2:]
        causal = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores, dim=-1)
    return (weights * dropout_mask(weights.shape[1:], p, weights)) @ v


def _multi_head_signature(
    query: Any, key: Any, value: Any, embed_dim_to_check: int, num_heads: int, in_proj_weight: Any, in_proj_bias: Any,
    bias_k: Any, bias_v: Any, add_zero_attn: bool, dropout_p: float, out_proj_weight: Any, out_proj_bias: Any,
    training: bool = True, key_padding_mask: Any = None, need_weights: bool = True, attn_mask: Any = None,
    use_separate_proj_weight: bool = False, q_proj_weight: Any = None, k_proj_weight: Any = None,
    v_proj_weight: Any = None, static_k: Any = None, static_v: Any = None, average_attn_weights: bool = True,
    is_causal: bool = False,
) -> None: ...  # fmt: skip


_MULTI_HEAD = inspect.signature(_multi_head_signature)


def replayable_multi_head(call: Call) -> bool:
    """Whether a recorded ``F.multi_head_attention_forward`` has a batched form: no masks,
    no added key and value biases, keys or zeros."""
    try:
        bound = _MULTI_HEAD.bind(*call.args, **call.kwargs)
    except TypeError:
        return False
    bound.apply_defaults()
    a = bound.arguments
    absent = ("bias_k", "bias_v", "key_padding_mask", "attn_mask", "static_k", "static_v")
    weights = ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "q_proj_weight", "k_proj_weight",
               "v_proj_weight")  # fmt: skip
    own = all(isinstance(a[name], (Param, type(None))) for name in weights)  # not computed in the forward
    return own and all(a[name] is None for name in absent) and not (a["add_zero_attn"] or a["is_causal"])


def multi_head_attention(k: int, *args: Any, **kwargs: Any) -> tuple[Value, Value | None]:
    """``F.multi_head_attention_forward`` for every member (what :func:`replayable_multi_head`
    lets through): its output ``[k, L, N, E]`` and, with ``need_weights``, its weights."""
    bound = _MULTI_HEAD.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    for name in ("in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias", "q_proj_weight",
                 "k_proj_weight", "v_proj_weight"):  # fmt: skip
        a[name] = stacked_weight(a[name], k)
    batched = _member_dims(a["query"], k) == 3
    query, key, value = (_rows_of(a[name], k, batched) for name in ("query", "key", "value"))
    heads = a["num_heads"]
    q, k_, v = _projections(a, query, key, value, k)
    length, rows, features = query.shape[1:]
    q, k_, v = (_split_heads(t, heads) for t in (q, k_, v))  # [k, N, H, L, head features]
    p = a["dropout_p"] if a["training"] else 0.0
    if a["need_weights"]:
        scores = (q * math.sqrt(1.0 / float(q.shape[-1]))) @ k_.transpose(-2, -1)
        weights = torch.softmax(scores, dim=-1)
        if p > 0.0:  # the weights torch hands back are the dropped ones too
            weights = weights * dropout_mask(weights.shape[1:], p, weights)
        out = weights @ v
        weights = weights.mean(dim=2) if a["average_attn_weights"] else weights
    elif p > 0.0:
        out, weights = _attention_with_dropout(q, k_, v, None, p, False, None, k), None
    else:
        folded = F.scaled_dot_product_attention(q.flatten(0, 1), k_.flatten(0, 1), v.flatten(0, 1))
        out, weights = folded.unflatten(0, (k, rows)), None
    out = out.permute(0, 3, 1, 2, 4).reshape(k, length * rows, features)  # [k, L * N, E], torch's order
    out = BatchedLinear.apply(out, a["out_proj_weight"], a["out_proj_bias"]).view(k, length, rows, -1)
    if not batched:
        out, weights = out.squeeze(2), None if weights is None else weights.squeeze(1)
    return Value(out, FRONT), None if weights is None else Value(weights, FRONT)


def _member_dims(value: Any, k: int) -> int:
    return len(member_shape(value, k)) if isinstance(value, Value) else value.dim() - 1


def _rows_of(value: Any, k: int, batched: bool) -> torch.Tensor:
    """A sequence's ``[k, L, N, E]``: an unbatched one's ``[k, L, E]`` with one row."""
    h = value if isinstance(value, torch.Tensor) else front(value, k)
    return h if batched else h.unsqueeze(2)


def _projections(a: dict[str, Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The query, key and value projections, ``[k, L, N, E]`` each: one product where the
    three are one value (self-attention), as torch makes it."""
    bias = a["in_proj_bias"]
    biases = (None,) * 3 if bias is None else bias.chunk(3, dim=-1)
    if a["use_separate_proj_weight"]:
        weights = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
    elif a["query"] is a["key"] is a["value"]:
        return tuple(_project(query, a["in_proj_weight"], bias).chunk(3, dim=-1))
    else:
        weights = a["in_proj_weight"].chunk(3, dim=1)
    return tuple(_project(x, w, b) for x, w, b in zip((query, key, value), weights, biases, strict=True))


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = BatchedLinear.apply(x.reshape(x.shape[0], -1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[1])


def _split_heads(h: torch.Tensor, heads: int) -> torch.Tensor:
    """``[k, L, N, E]`` as ``[k, N, heads, L, E / heads]``, torch's heads of a row."""
    k, length, rows, features = h.shape
    return h.reshape(k, length, rows, heads, features // heads).permute(0, 2, 3, 1, 4)
