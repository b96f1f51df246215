"""Matrix products of k members' weights at once.

>>> x, weight = torch.ones(2, 5, 3), torch.ones(2, 4, 3)  # 2 members' 5 rows and 4 x 3 weights
>>> BatchedLinear.apply(x, weight, None).shape
torch.Size([2, 5, 4])
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BatchedLinear"]


class BatchedLinear(torch.autograd.Function):
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
        # A loss may hand back its gradient transposed; the products round as for a plain
        # model's Linear only on the contiguous layout.
        grad = grad.contiguous()
        grad_x = torch.bmm(grad, weight) if ctx.needs_input_grad[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), x) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(1) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias
