"""Convolutions as matrix products (the fused CPU training path): every member's
output and gradients are those of its own ``F.conv1d``/``conv2d``, for the windows
whose taps fall on the padding, on positions no window reads, and on regions that
overlap in part."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from cerebro_automl.fusion.convolution import _Window, convolution_as_products

CASES = {
    # name: (positions, kernel, stride, padding, dilation)
    "k3-stride2-pad1": ((40,), (3,), (2,), (1,), (1,)),
    "k5-stride2-pad2": ((11,), (5,), (2,), (2,), (1,)),
    "k5-same": ((9,), (5,), (1,), "same", (1,)),
    "k3-stride2-overlapping-in-part": ((8,), (3,), (2,), (0,), (1,)),
    "k1-stride2-positions-never-read": ((7,), (1,), (2,), (0,), (1,)),
    "taps-only-on-the-padding": ((1,), (3,), (3,), (2,), (1,)),
    "dilated-wide-padding": ((3,), (2,), (1,), (4,), (3,)),
    "2d-3x3-stride2": ((8, 6), (3, 3), (2, 2), (1, 1), (1, 1)),
    "2d-3x3-stride2-odd-rows": ((7, 6), (3, 3), (2, 2), (1, 1), (1, 1)),
    "2d-mixed": ((7, 6), (4, 3), (2, 1), (2, 0), (1, 2)),
}


# Few filters: the filters are reordered to the columns' order; many (more weights than
# columns): the columns to the weight's own.
@pytest.mark.parametrize("out", [5, 256], ids=["few-filters", "many-filters"])
@pytest.mark.parametrize("rectify", [False, True], ids=["", "of-a-relu"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared-batch", "members-own-inputs"])
@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_each_members_convolution_and_gradients_are_its_own(case, shared, rectify, out):
    positions, kernel, stride, padding, dilation = case
    k, rows, channels = 3, 4, 2
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(k, out, channels, *kernel, generator=generator, requires_grad=True)
    bias = torch.randn(k, out, generator=generator, requires_grad=True)
    shape = (rows, *positions, channels) if shared else (k, rows, *positions, channels)
    x = torch.randn(shape, generator=generator)  # channels last
    x.view(-1)[::7] = 0.0  # ReLU's gradient at 0 is 0
    x.requires_grad_()

    fused = convolution_as_products(x, weight, bias, stride=stride, padding=padding, dilation=dilation,
                                    shared=shared, rectify=rectify)  # fmt: skip
    upstream = torch.randn(fused.shape, generator=generator)
    fused_grads = torch.autograd.grad(fused, (x, weight, bias), upstream)

    # Each member's own convolution in float64: the products and torch's float32 kernels
    # both round, and with many filters an input's gradient sums enough terms for their
    # two roundings to differ by more than float32's tolerance.
    conv = {1: F.conv1d, 2: F.conv2d}[len(kernel)]
    x64, weight64, bias64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    alone = []
    for i in range(k):
        member_x = (x64.relu() if rectify else x64) if shared else (x64[i].relu() if rectify else x64[i])
        member_x = member_x.movedim(-1, 1)
        alone.append(conv(member_x, weight64[i], bias64[i], stride, padding, dilation).movedim(1, -1))
    expected = torch.stack(alone)
    expected_grads = torch.autograd.grad(expected, (x64, weight64, bias64), upstream.double())

    for name, got, want in zip(("output", "input", "weight", "bias"), (fused, *fused_grads),
                               (expected, *expected_grads), strict=True):  # fmt: skip
        # float32's rounding of a sum grows with its terms: absolutely, for values near 0
        atol = max(1e-5, 2e-6 * want.abs().max().item())
        torch.testing.assert_close(got, want.float(), rtol=1.3e-6, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case, block, zeros, copies", [
    ("k3-stride2-pad1", ((1, 2),), False, 0), ("k5-same", ((2, 1),), False, 0),
    ("2d-3x3-stride2", ((1, 2), (1, 2)), False, 0), ("2d-3x3-stride2-odd-rows", None, False, 4),
    ("k5-stride2-pad2", None, False, 2),
    ("k1-stride2-positions-never-read", None, True, 1), ("k3-stride2-overlapping-in-part", None, True, 0),
])  # fmt: skip
def test_the_input_gradient_starts_from_zeros_only_where_a_position_needs_them(case, block, zeros, copies):
    """Common convolutions put their columns back as one copy of a block of taps that
    reads every position once, then sums; without such a block, as copies and sums, with
    zeros only where no window reads a position; regions that overlap in part are all summed."""
    positions, kernel, stride, padding, dilation = CASES[case]
    scatter = _Window.of(kernel, positions, stride, padding, dilation).scatter
    assert (scatter.block, scatter.zeros) == (block, zeros)
    assert sum(step.copy for step in scatter.steps) == copies
