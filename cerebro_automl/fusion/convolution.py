"""k members' convolutions as matrix products (im2col), for the CPU.

On the CPU a grouped convolution with one group per member is slower than the
members' convolutions one by one; a batched matrix product is not. The input's
windows are cut once, their taps side by side (``[k, rows * positions, taps *
channels]``), and multiplied by each member's filters (``[k, taps * channels,
out]``). Activations keep the members in front and the channels last
(``[k, rows, ...positions, channels]``): the layout the next convolution's windows
are cut from, and the one the products give. These steps are memory-bound on the
CPU, so the padding is never written out (each tap's columns are copied from the
input, zeros where the tap falls on the padding), the bias is added in the product,
and the input's gradient is mostly copies, with zeros only where it needs them.

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

import functools
import itertools
from typing import Any, NamedTuple

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
    return _ConvolutionAsProducts.apply(x, weight, bias, window, shared)


class _Tap(NamedTuple):
    """Where one of the kernel's taps reads: in the windows that put it on the input
    rather than on its padding (``outputs``, an index of the output positions), the
    input positions it reads (``inputs``); and per position dimension, how many output
    positions before and after those put it on the padding."""

    outputs: tuple[Any, ...]
    inputs: tuple[Any, ...]
    over_padding: tuple[tuple[int, int], ...]

    @property
    def reads_input(self) -> bool:
        return all(s.stop > s.start for s in self.outputs[1:-1])


class _Scatter(NamedTuple):
    """How the taps' columns go back into the input's gradient: onto zeros or not, and
    in which order, each tap's as a copy (the first to reach its positions) or a sum."""

    zeros: bool
    steps: list[tuple[int, bool]]


class _Window:
    """Where a convolution's windows lie in its input: the padding before and after each
    position dimension and, for each of the kernel's taps, the input positions it reads.
    The padding is never materialized: a window's columns over it are zeros."""

    def __init__(
        self, kernel: tuple[int, ...], positions: tuple[int, ...], padding: list[tuple[int, int]],
        stride: tuple[int, ...], dilation: tuple[int, ...], out_shape: tuple[int, ...],
    ) -> None:  # fmt: skip
        self.kernel, self.positions, self.padding = kernel, positions, padding
        self.stride, self.dilation, self.out_shape = stride, dilation, out_shape
        offsets = [[i * d for i in range(size)] for size, d in zip(kernel, dilation, strict=True)]
        self.taps = [self._tap(tap) for tap in itertools.product(*offsets)]
        self.scatter = _scatter(self)

    @classmethod
    @functools.lru_cache(maxsize=256)
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
        return cls(kernel, positions, sides, stride, dilation, out_shape)

    def _tap(self, offsets: tuple[int, ...]) -> _Tap:
        outputs, inputs, over_padding = [], [], []
        dims = zip(offsets, self.positions, self.padding, self.stride, self.out_shape, strict=True)
        for offset, n, (before, _), s, n_out in dims:
            shift = offset - before  # output position o reads input position o * s + shift
            first = min(n_out, max(0, -(shift // s)))
            last = max(first, min(n_out, (n - 1 - shift) // s + 1))
            start = first * s + shift
            outputs.append(slice(first, last))
            inputs.append(slice(start, start + s * (last - first - 1) + 1, s) if last > first else slice(0, 0))
            over_padding.append((first, n_out - last))
        return _Tap((..., *outputs, slice(None)), (..., *inputs, slice(None)), tuple(over_padding))

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """Every window of ``x`` (``[..., positions, channels]``) as one row,
        ``[..., ...out positions, taps * channels]``, the taps in the order of ``taps``."""
        dims = len(self.kernel)
        columns = x.new_empty(*x.shape[: -1 - dims], *self.out_shape, len(self.taps), x.shape[-1])
        for i, tap in enumerate(self.taps):
            column = columns[..., i, :]
            if not tap.reads_input:
                column.zero_()
                continue
            column[tap.outputs] = x[tap.inputs]
            for d, (before, after) in enumerate(tap.over_padding):
                rest: tuple[Any, ...] = (slice(None),) * (dims - d)  # the later position dimensions, the channels
                if before:
                    column[(..., slice(0, before), *rest)] = 0
                if after:
                    column[(..., slice(self.out_shape[d] - after, None), *rest)] = 0
        return columns.view(*columns.shape[:-2], -1)

    def scatter_back(self, grad_columns: torch.Tensor) -> torch.Tensor:
        """The gradient of the input that ``columns`` cut ``grad_columns``' columns from
        (``[..., ...out positions, taps, channels]``): each tap's added back where it read."""
        dims = len(self.kernel)
        shape = (*grad_columns.shape[: -2 - dims], *self.positions, grad_columns.shape[-1])
        grad_x = grad_columns.new_zeros(shape) if self.scatter.zeros else grad_columns.new_empty(shape)
        for i, copy in self.scatter.steps:
            tap = self.taps[i]
            source = grad_columns[..., i, :][tap.outputs]
            if copy:
                grad_x[tap.inputs] = source
            else:
                grad_x[tap.inputs] += source
        return grad_x


def _scatter(window: _Window) -> _Scatter:
    """The taps with the larger regions first: where then each tap's region is either
    new or reached before as a whole, its columns are copied or added, and the gradient
    starts from zeros only if some position is never read. Else (a stride that makes
    regions overlap in part) every tap's columns are added onto zeros, in the taps' order."""
    regions = []
    for tap in window.taps:
        region = torch.zeros(window.positions, dtype=torch.bool)
        region[tap.inputs[1:-1]] = True
        regions.append(region)
    reached = torch.zeros(window.positions, dtype=torch.bool)
    steps = []
    for i in sorted(range(len(regions)), key=lambda i: -int(regions[i].sum())):
        region = regions[i]
        new = region & ~reached
        if new.any() and not torch.equal(new, region):
            return _Scatter(True, [(i, False) for i, region in enumerate(regions) if region.any()])
        if region.any():
            steps.append((i, bool(new.any())))
        reached |= region
    return _Scatter(not bool(reached.all()), steps)


class _ConvolutionAsProducts(torch.autograd.Function):
    """The convolutions: the windows' columns times each member's filters, the bias
    added in the product; on a shared batch the columns are cut once and all members'
    filters are one matrix. The backward gives the weight's gradient in its own layout,
    and the input's by adding each tap's columns back where they were cut."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: _Window, shared: bool
    ) -> torch.Tensor:
        columns = window.columns(x)
        filters = _filters(weight)
        ctx.window, ctx.shared, ctx.has_bias = window, shared, bias is not None
        ctx.save_for_backward(columns, filters)
        k, width, out = filters.shape
        if shared:
            matrix = filters.transpose(0, 1).reshape(width, k * out)
            flat = columns.reshape(-1, width)
            product = flat @ matrix if bias is None else torch.addmm(bias.reshape(k * out), flat, matrix)
            return product.view(*columns.shape[:-1], k, out).movedim(-2, 0)
        flat = columns.view(k, -1, width)
        product = torch.bmm(flat, filters) if bias is None else torch.baddbmm(bias.unsqueeze(1), flat, filters)
        return product.view(*columns.shape[:-1], out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        columns, filters = ctx.saved_tensors
        window: _Window = ctx.window
        k, width, out = filters.shape
        grad_x = grad_weight = grad_bias = None
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
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0).view(k, out) if ctx.shared else grad.sum(1)
        if ctx.needs_input_grad[0]:
            if ctx.shared:  # the members' gradients summed: one product over all their filters
                grad_columns = grad @ filters.transpose(1, 2).reshape(k * out, width)
            else:
                grad_columns = torch.bmm(grad, filters.transpose(1, 2))
            grad_x = window.scatter_back(grad_columns.view(*columns.shape[:-1], len(window.taps), -1))
        return grad_x, grad_weight, grad_bias, None, None


def _filters(weight: torch.Tensor) -> torch.Tensor:
    """``[k, out, channels, ...kernel]`` as ``[k, taps * channels, out]``, the taps in
    the order of ``_Window.taps``."""
    k, out = weight.shape[:2]
    return weight.permute(0, *range(3, weight.dim()), 2, 1).reshape(k, -1, out)
