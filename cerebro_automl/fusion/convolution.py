"""k members' convolutions as matrix products (im2col), for the CPU.

On the CPU a grouped convolution with one group per member is slower than the
members' convolutions one by one; a batched matrix product is not. The input's
windows are cut once, their taps side by side (``[k, rows * positions, taps *
channels]``), and multiplied by each member's filters (``[k, taps * channels,
out]``). Activations keep the members in front and the channels last
(``[k, rows, ...positions, channels]``): the layout the next convolution's windows
are cut from, and the one the products give. The steps between the products are
memory-bound on the CPU, so each moves the data once where it can: the padding is
never written out (the windows on the input are one strided copy, those at its
edges are cut tap by tap, zeros over the padding), a ReLU before the convolution
is applied as the windows are cut, the bias is added in the product, and the
input's gradient starts with one copy of a block of taps that reads each position
once, with zeros only where no window reads a position.

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
    rectify: bool = False,
) -> torch.Tensor:
    """Every member's convolution, ``[k, rows, ...positions, out]``: ``x`` is
    ``[k, rows, ...positions, channels]``, or with ``shared`` one batch for all
    (``[rows, ...positions, channels]``); ``weight`` ``[k, out, channels, ...kernel]``
    and ``bias`` ``[k, out]`` are the members' stacked filters; ``stride``,
    ``padding`` (numbers, ``"same"`` or ``"valid"``) and ``dilation`` as ``F.conv1d``'s.
    With ``rectify``, the convolution of ``relu(x)``, rectified as its windows are cut
    (no pass of its own over ``x``, no tensor for it)."""
    dims = weight.dim() - 3
    window = _Window.of(tuple(weight.shape[3:]), tuple(x.shape[-1 - dims : -1]), stride, padding, dilation)
    return _ConvolutionAsProducts.apply(x, weight, bias, window, shared, rectify)


class _Tap(NamedTuple):
    """Where one of the kernel's taps reads: output position ``o`` of dimension ``d``
    reads input position ``o * stride[d] + shift[d]``, on the input (not its padding)
    for ``first[d] <= o < last[d]``."""

    shift: tuple[int, ...]
    first: tuple[int, ...]
    last: tuple[int, ...]
    stride: tuple[int, ...]

    def within(self, box: list[tuple[int, int]]) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
        """The index of the output positions in ``box`` where this tap reads the input
        and that of the input positions it reads there; None where it reads only padding."""
        outputs, inputs = [], []
        for (start, stop), *reads, shift, s in zip(box, self.first, self.last, self.shift, self.stride, strict=True):
            first, last = max(reads[0], start), min(reads[1], stop)
            if last <= first:
                return None
            outputs.append(slice(first, last))
            inputs.append(slice(first * s + shift, (last - 1) * s + shift + 1, s))
        return (..., *outputs, slice(None)), (..., *inputs, slice(None))


class _Scatter(NamedTuple):
    """How the taps' columns go back into the input's gradient: first, where there is
    one, a block of taps that reads every input position once (per position dimension
    its first tap and count, as many as the stride), copied in one pass; then onto
    that, or onto zeros, the taps in ``steps``' order, each as a copy (the first to
    reach its positions) or a sum."""

    block: tuple[tuple[int, int], ...] | None
    zeros: bool
    steps: list[_Step]


class _Step(NamedTuple):
    """One tap's columns (at ``outputs``) copied or added to the input's gradient (at ``inputs``)."""

    tap: int
    copy: bool
    outputs: tuple[Any, ...]
    inputs: tuple[Any, ...]


class _Edge(NamedTuple):
    """Output positions at an edge of the input (``box``, an index of the columns), and
    the taps that read the input there: (tap, its output positions, the input positions)."""

    box: tuple[Any, ...]
    reads: list[tuple[int, tuple[Any, ...], tuple[Any, ...]]]


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
        #: each tap's output positions on the input and the input positions it reads there
        self.reads = [tap.within([(0, n) for n in out_shape]) for tap in self.taps]
        self.scatter = _scatter(self)
        self.inner, self.edges = self._cut_plan()

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
        shifts, firsts, lasts = [], [], []
        dims = zip(offsets, self.positions, self.padding, self.stride, self.out_shape, strict=True)
        for offset, n, (before, _), s, n_out in dims:
            shift = offset - before
            first = min(n_out, max(0, -(shift // s)))
            shifts.append(shift)
            firsts.append(first)
            lasts.append(max(first, min(n_out, (n - 1 - shift) // s + 1)))
        return _Tap(tuple(shifts), tuple(firsts), tuple(lasts), self.stride)

    def _cut_plan(self) -> tuple[list[tuple[int, int]] | None, list[_Edge]]:
        """Where ``columns`` cuts the windows: the output positions whose windows all lie
        on the input (None where there are none), and the edges around them, each with
        the taps that read the input there and where."""
        dims = len(self.kernel)
        inner = [(max(t.first[d] for t in self.taps), min(t.last[d] for t in self.taps)) for d in range(dims)]
        everywhere = [(0, n) for n in self.out_shape]
        has_inner = all(stop > start for start, stop in inner)
        if not has_inner:
            boxes = [everywhere]
        else:  # before and after the inner positions, dimension by dimension; the corners twice, alike
            boxes = [[*everywhere[:d], side, *everywhere[d + 1 :]] for d, n in enumerate(self.out_shape)
                     for side in ((0, inner[d][0]), (inner[d][1], n))]  # fmt: skip
        edges = []
        for box in boxes:
            if all(stop > start for start, stop in box):
                reads = [(i, *found) for i, tap in enumerate(self.taps) if (found := tap.within(box)) is not None]
                edges.append(_Edge(_index(box, 2), reads))
        return (inner if has_inner else None), edges

    def columns(self, x: torch.Tensor, rectify: bool = False) -> torch.Tensor:
        """Every window of ``x`` (``[..., positions, channels]``) as one row,
        ``[..., ...out positions, taps * channels]``, the taps in the order of ``taps``:
        the windows that lie on the input copied in one pass, then those at its edges
        (over the padding) tap by tap; with ``rectify``, ``relu(x)``'s windows."""
        dims = len(self.kernel)
        columns = x.new_empty(*x.shape[: -1 - dims], *self.out_shape, len(self.taps), x.shape[-1])
        if self.inner is not None:
            _copy(self._windows(x, self.inner), columns[_index(self.inner, 2)], rectify)
        for edge in self.edges:
            columns[edge.box] = 0
            for i, outputs, inputs in edge.reads:
                _copy(x[inputs], columns[..., i, :][outputs], rectify)
        return columns.view(*columns.shape[:-2], -1)

    def _windows(self, x: torch.Tensor, inner: list[tuple[int, int]]) -> torch.Tensor:
        """The windows of the output positions in ``inner`` (which lie on the input),
        ``[..., ...positions, taps, channels]``: strided views of ``x``."""
        dims, windows = len(self.kernel), x
        for d, ((start, stop), size, s, dilation, (before, _)) in enumerate(
            zip(inner, self.kernel, self.stride, self.dilation, self.padding, strict=True)
        ):
            dim = x.dim() - 1 - dims + d
            span = dilation * (size - 1) + 1
            windows = windows.narrow(dim, start * s - before, (stop - start - 1) * s + span).unfold(dim, span, s)
            if dilation > 1:
                windows = windows[..., ::dilation]
        # [..., ...positions, channels, ...kernel] -> [..., ...positions, taps, channels]
        windows = windows.movedim(-1 - dims, -1)
        return windows.reshape(*windows.shape[: -1 - dims], -1, windows.shape[-1])

    def scatter_back(self, grad_columns: torch.Tensor) -> torch.Tensor:
        """The gradient of the input that ``columns`` cut ``grad_columns``' columns from
        (``[..., ...out positions, taps, channels]``): each tap's added back where it read."""
        dims = len(self.kernel)
        shape = (*grad_columns.shape[: -2 - dims], *self.positions, grad_columns.shape[-1])
        grad_x = grad_columns.new_zeros(shape) if self.scatter.zeros else grad_columns.new_empty(shape)
        if self.scatter.block is not None:
            self._copy_block(grad_columns, grad_x, self.scatter.block)
        for step in self.scatter.steps:
            source = grad_columns[..., step.tap, :][step.outputs]
            if step.copy:
                grad_x[step.inputs] = source
            else:
                grad_x[step.inputs] += source
        return grad_x

    def _copy_block(self, grad_columns: torch.Tensor, grad_x: torch.Tensor, block: tuple[tuple[int, int], ...]) -> None:
        """The block's taps, ``count`` of them from ``first`` in each position dimension,
        read output position ``o``'s input positions ``o * count`` to ``o * count + count - 1``:
        their columns, interleaved with the output positions, are the whole input's."""
        dims, lead, channels = len(self.kernel), grad_x.shape[: -1 - len(self.kernel)], grad_x.shape[-1]
        by_kernel = grad_columns.view(*lead, *self.out_shape, *self.kernel, channels)
        taps = by_kernel[_index([(first, first + count) for first, count in block], 1)]
        n = len(lead)
        order = [*range(n), *[i for d in range(dims) for i in (n + d, n + dims + d)], n + 2 * dims]
        interleaved = [size for d in range(dims) for size in (self.out_shape[d], block[d][1])]
        grad_x.view(*lead, *interleaved, channels).copy_(taps.permute(order))


def _copy(source: torch.Tensor, target: torch.Tensor, rectify: bool) -> None:
    """``target[...] = source``, or ``relu(source)`` with ``rectify``, in one pass."""
    if rectify:
        torch.clamp_min(source, 0, out=target)
    else:
        target.copy_(source)


def _index(ranges: list[tuple[int, int]], trailing: int) -> tuple[Any, ...]:
    """The index of ``ranges`` in the position dimensions, followed by ``trailing`` whole dimensions."""
    return (..., *[slice(start, stop) for start, stop in ranges], *[slice(None)] * trailing)


def _block(window: _Window) -> tuple[tuple[int, int], ...] | None:
    """Per position dimension, the first of ``stride`` consecutive taps that together
    read each input position once (output position o: o * stride to o * stride + stride - 1),
    and their count; None where some dimension has none (a dilation with a stride, a
    stride larger than the kernel, outputs that do not tile the input)."""
    block = []
    dims = zip(window.kernel, window.positions, window.padding, window.stride, window.dilation, window.out_shape,
               strict=True)  # fmt: skip
    for size, n, (before, _), s, dilation, n_out in dims:
        if n_out * s != n:
            return None
        if s == 1 and before % dilation == 0 and before // dilation < size:
            block.append((before // dilation, 1))
        elif dilation == 1 and before + s <= size:
            block.append((before, s))
        else:
            return None
    return tuple(block)


def _scatter(window: _Window) -> _Scatter:
    """A block of taps copied first, then the other taps added, the larger regions first.
    Without a block, the taps with the larger regions first: where then each tap's region
    is either new or reached before as a whole, its columns are copied or added, and the
    gradient starts from zeros only if some position is never read. Else (a stride that
    makes regions overlap in part) every tap's columns are added onto zeros, in the taps'
    order."""
    regions = []
    for found in window.reads:
        region = torch.zeros(window.positions, dtype=torch.bool)
        if found is not None:
            region[found[1][1:-1]] = True
        regions.append(region)
    by_size = sorted(range(len(regions)), key=lambda i: -int(regions[i].sum()))
    reading = [i for i in by_size if window.reads[i] is not None]

    def steps(order: list[tuple[int, bool]]) -> list[_Step]:
        return [_Step(i, copy, *found) for i, copy in order if (found := window.reads[i]) is not None]

    block = _block(window)
    if block is not None:
        in_block = set(itertools.product(*[range(first, first + count) for first, count in block]))
        taps = list(itertools.product(*[range(size) for size in window.kernel]))
        return _Scatter(block, False, steps([(i, False) for i in reading if taps[i] not in in_block]))
    reached = torch.zeros(window.positions, dtype=torch.bool)
    order = []
    for i in reading:
        region = regions[i]
        new = region & ~reached
        if new.any() and not torch.equal(new, region):
            return _Scatter(None, True, steps([(i, False) for i in sorted(reading)]))
        order.append((i, bool(new.any())))
        reached |= region
    return _Scatter(None, not bool(reached.all()), steps(order))


class _ConvolutionAsProducts(torch.autograd.Function):
    """The convolutions: the windows' columns times each member's filters, the bias
    added in the product; on a shared batch the columns are cut once and all members'
    filters are one matrix. The backward gives the weight's gradient in its own layout,
    and the input's by adding each tap's columns back where they were cut.

    The products need the columns and the filters with their taps and channels in one
    order. The smaller of the two is reordered, each step and in both directions: where
    the columns are fewer than the filters (a ResNet's last stages, few positions, many
    channels), they take the weight's own order (each channel's taps side by side), so
    that the weight is used as it lies and its gradient comes out in its own layout.
    Reordering ResNet-18's 8 x 11M weights instead took a quarter of its fused step."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, window: _Window, shared: bool,
        rectify: bool,
    ) -> torch.Tensor:  # fmt: skip
        columns = window.columns(x, rectify)
        k, out = weight.shape[:2]
        weight_order = columns.numel() < weight.numel()
        if weight_order:
            columns = _by_channel(columns, len(window.taps))
            filters = weight.reshape(k, out, -1).transpose(1, 2)  # a view: [k, channels * taps, out]
        else:
            filters = _filters(weight)
        ctx.window, ctx.shared, ctx.has_bias, ctx.rectify = window, shared, bias is not None, rectify
        ctx.weight_order, ctx.weight_shape = weight_order, weight.shape
        ctx.save_for_backward(columns, filters, x if rectify and ctx.needs_input_grad[0] else None)
        flat = _members_columns(columns, k, shared)
        # The products written into the output's own tensor: a view of one made here could
        # not be changed in place (an in-place ReLU after the convolution).
        product = columns.new_empty(k, *columns.shape[int(not shared) : -1], out)
        if bias is None:
            torch.bmm(flat, filters, out=product.view(k, -1, out))
        else:
            torch.baddbmm(bias.unsqueeze(1), flat, filters, out=product.view(k, -1, out))
        return product

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        columns, filters, x = ctx.saved_tensors
        window: _Window = ctx.window
        k, _, out = filters.shape
        grad_x = grad_weight = grad_bias = None
        grad = grad.reshape(k, -1, out)
        if ctx.needs_input_grad[1]:
            by_tap = torch.bmm(grad.transpose(1, 2), _members_columns(columns, k, ctx.shared))
            if ctx.weight_order:  # [k, out, channels * taps]: the weight's own layout
                grad_weight = by_tap.view(ctx.weight_shape)
            else:  # [k, out, taps * channels] into the weight's own layout, [k, out, channels, ...kernel]
                grad_weight = by_tap.reshape(k, out, *window.kernel, -1).movedim(-1, 2).contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(1)
        if ctx.needs_input_grad[0]:
            grad_columns = torch.bmm(grad, filters.transpose(1, 2))
            if ctx.shared:  # the members' gradients summed
                grad_columns = grad_columns.sum(0)
            if ctx.weight_order:
                grad_columns = _by_tap(grad_columns, len(window.taps))
            grad_x = window.scatter_back(grad_columns.view(*columns.shape[:-1], len(window.taps), -1))
            if ctx.rectify:  # ReLU's own backward, in place on the new gradient: 0 where x <= 0
                torch.ops.aten.threshold_backward.grad_input(grad_x, x, 0, grad_input=grad_x)
        return grad_x, grad_weight, grad_bias, None, None, None


def _by_channel(columns: torch.Tensor, taps: int) -> torch.Tensor:
    """Columns ``[..., taps * channels]`` reordered to ``[..., channels * taps]``, the
    weight's own order (a copy)."""
    lead = columns.shape[:-1]
    return columns.view(*lead, taps, -1).transpose(-1, -2).reshape(*lead, -1)


def _by_tap(columns: torch.Tensor, taps: int) -> torch.Tensor:
    """Columns ``[..., channels * taps]`` back in the order the windows are cut,
    ``[..., taps * channels]`` (a copy)."""
    lead = columns.shape[:-1]
    return columns.view(*lead, -1, taps).transpose(-1, -2).reshape(*lead, -1)


def _members_columns(columns: torch.Tensor, k: int, shared: bool) -> torch.Tensor:
    """The columns each member multiplies, ``[k, rows * positions, taps * channels]``:
    on a shared batch, one matrix for all (a view, not k copies)."""
    width = columns.shape[-1]
    return columns.reshape(1, -1, width).expand(k, -1, -1) if shared else columns.view(k, -1, width)


def _filters(weight: torch.Tensor) -> torch.Tensor:
    """``[k, out, channels, ...kernel]`` as ``[k, taps * channels, out]``, the taps in
    the order of ``_Window.taps``."""
    k, out = weight.shape[:2]
    return weight.permute(0, *range(3, weight.dim()), 2, 1).reshape(k, -1, out)
