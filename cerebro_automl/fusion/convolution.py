"""k members' convolutions as matrix products (im2col), for the CPU.

On the CPU a grouped convolution with one group per member is slower than the
members' convolutions one by one; a batched matrix product is not. The input's
windows are cut once, their taps side by side (``[k, rows * positions, taps *
channels]``), and multiplied by each member's filters (``[k, taps * channels,
out]``). Activations keep the members in front and the channels last
(``[k, rows, ...positions, channels]``): the layout the next convolution's windows
are cut from, and the one the products give.

>>> x = torch.randn(4, 10, 3)  # a shared batch: 4 rows, 10 positions, 3 channels
>>> weight = torch.randn(2, 5, 3, 3)  # 2 members, 5 filters of 3 channels x 3 taps
>>> out = convolution_as_products(x, weight, None, stride=(1,), padding=(1,), dilation=(1,), shared=True)
>>> tuple(out.shape)
(2, 4, 10, 5)
>>> alone = torch.nn.functional.conv1d(x.movedim(-1, 1), weight[1], padding=1).movedim(1, -1)
>>> torch.allclose(out[1], alone, atol=1e-5)
True
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

__all__ = ["convolution_as_products"]


def convolution_as_products(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    stride: tuple[int, ...],
    padding: tuple[int, ...] | str,
    dilation: tuple[int, ...],
    shared: bool,
) -> torch.Tensor:
    """Every member's convolution, ``[k, rows, ...positions, out]``: ``x`` is
    ``[k, rows, ...positions, channels]``, or with ``shared`` one batch for all
    (``[rows, ...positions, channels]``); ``weight`` ``[k, out, channels, ...kernel]``
    and ``bias`` ``[k, out]`` are the members' stacked filters; ``stride``,
    ``padding`` (numbers, ``"same"`` or ``"valid"``) and ``dilation`` as ``F.conv1d``'s."""
    dims = weight.dim() - 3
    window = _Window.of(tuple(weight.shape[3:]), tuple(x.shape[-1 - dims : -1]), stride, padding, dilation)
    out = _ConvolutionAsProducts.apply(x, weight, window, shared)
    return out if bias is None else out + bias.view(bias.shape[0], *[1] * (out.dim() - 2), -1)


class _Window:
    """Where a convolution's windows lie in its input: the padding before and after each
    position dimension, and the offsets of the kernel's taps, each read as one strided
    slice of the padded input."""

    def __init__(
        self, kernel: tuple[int, ...], padding: list[tuple[int, int]], stride: tuple[int, ...],
        dilation: tuple[int, ...], out_shape: tuple[int, ...],
    ) -> None:  # fmt: skip
        self.kernel, self.padding, self.stride, self.dilation = kernel, padding, stride, dilation
        self.out_shape = out_shape
        offsets = [[i * d for i in range(size)] for size, d in zip(kernel, dilation, strict=True)]
        self.taps = list(itertools.product(*offsets))

    @classmethod
    def of(
        cls, kernel: tuple[int, ...], positions: tuple[int, ...], stride: tuple[int, ...],
        padding: tuple[int, ...] | str, dilation: tuple[int, ...],
    ) -> _Window:  # fmt: skip
        spans = [d * (size - 1) for d, size in zip(dilation, kernel, strict=True)]
        sides: list[tuple[int, int]]
        if isinstance(padding, str):
            if padding not in ("valid", "same"):
                raise ValueError(f"padding {padding!r}: a convolution's padding as text is 'valid' or 'same'")
            # "same": torch's split, the odd one after
            sides = [(0, 0)] * len(kernel) if padding == "valid" else [(span // 2, span - span // 2) for span in spans]
        else:
            sides = [(p, p) for p in padding]
        out_shape = tuple(
            (n + before + after - span - 1) // s + 1
            for n, (before, after), span, s in zip(positions, sides, spans, stride, strict=True)
        )
        return cls(kernel, sides, stride, dilation, out_shape)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[..., positions, channels]``) with its zero padding."""
        flat = [side for before_after in reversed(self.padding) for side in before_after]
        return torch.nn.functional.pad(x, [0, 0, *flat]) if any(flat) else x

    def columns(self, padded: torch.Tensor) -> torch.Tensor:
        """Every window of ``padded`` as one row, ``[..., ...out positions, taps * channels]``,
        the taps in the order of ``taps``: strided views of the windows, copied once."""
        dims, windows = len(self.kernel), padded
        for d, (size, stride, dilation) in enumerate(zip(self.kernel, self.stride, self.dilation, strict=True)):
            windows = windows.unfold(padded.dim() - 1 - dims + d, dilation * (size - 1) + 1, stride)
            if dilation > 1:
                windows = windows[..., ::dilation]
        # [..., ...out positions, channels, ...kernel] -> [..., ...out positions, ...kernel, channels]
        windows = windows.movedim(-1 - dims, -1)
        return windows.reshape(*windows.shape[: -1 - dims], -1).contiguous()

    def tap(self, offsets: tuple[int, ...]) -> tuple[Any, ...]:
        """The index of the padded input's positions that the tap at ``offsets`` of each window reads."""
        positions = zip(offsets, self.stride, self.out_shape, strict=True)
        return (..., *[slice(o, o + s * (n - 1) + 1, s) for o, s, n in positions], slice(None))

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the padded input's shape) without the padding."""
        sizes = x.shape[-1 - len(self.padding) : -1]
        kept = [slice(before, n - after) for n, (before, after) in zip(sizes, self.padding, strict=True)]
        index: tuple[Any, ...] = (..., *kept, slice(None))
        return x[index]


class _ConvolutionAsProducts(torch.autograd.Function):
    """The convolutions without their bias: the windows' columns times each member's
    filters; on a shared batch the columns are cut once and all members' filters are
    one matrix. The backward gives the weight's gradient in its own layout, and the
    input's by adding each tap's columns back where they were cut."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, window: _Window, shared: bool) -> torch.Tensor:
        padded = window.pad(x)
        columns = window.columns(padded)
        filters = _filters(weight)
        ctx.window, ctx.shared, ctx.padded_shape = window, shared, padded.shape
        ctx.save_for_backward(columns, filters)
        k, width, out = filters.shape
        if shared:
            product = columns.reshape(-1, width) @ filters.transpose(0, 1).reshape(width, k * out)
            return product.view(*columns.shape[:-1], k, out).movedim(-2, 0)
        return torch.bmm(columns.view(k, -1, width), filters).view(*columns.shape[:-1], out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        columns, filters = ctx.saved_tensors
        window: _Window = ctx.window
        k, width, out = filters.shape
        grad_x = grad_weight = None
        # On a shared batch, the members' gradients side by side ([rows * positions, k * out]),
        # as the product gave them; else [k, rows * positions, out].
        grad = grad.movedim(0, -2).reshape(-1, k * out) if ctx.shared else grad.reshape(k, -1, out)
        if ctx.needs_input_grad[1]:
            if ctx.shared:
                by_tap = (columns.view(-1, width).t() @ grad).view(width, k, out).permute(1, 2, 0)
            else:
                by_tap = torch.bmm(grad.transpose(1, 2), columns.view(k, -1, width))
            # [k, out, taps * channels] in the weight's own layout, [k, out, channels, ...kernel]
            grad_weight = by_tap.reshape(k, out, *window.kernel, -1).movedim(-1, 2).contiguous()
        if ctx.needs_input_grad[0]:
            if ctx.shared:  # the members' gradients summed: one product over all their filters
                grad_columns = grad @ filters.transpose(1, 2).reshape(k * out, width)
            else:
                grad_columns = torch.bmm(grad, filters.transpose(1, 2))
            grad_columns = grad_columns.view(*columns.shape[:-1], len(window.taps), -1)
            grad_padded = grad.new_zeros(ctx.padded_shape)
            for i, offsets in enumerate(window.taps):
                grad_padded[window.tap(offsets)] += grad_columns[..., i, :]
            grad_x = window.unpad(grad_padded)
        return grad_x, grad_weight, None, None


def _filters(weight: torch.Tensor) -> torch.Tensor:
    """``[k, out, channels, ...kernel]`` as ``[k, taps * channels, out]``, the taps in
    the order of ``_Window.taps``."""
    k, out = weight.shape[:2]
    return weight.permute(0, *range(3, weight.dim()), 2, 1).reshape(k, -1, out)
