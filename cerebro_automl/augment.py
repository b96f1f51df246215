"""Seeded, batched image augmentation on the device, for ``TrainingSpec(train_transform=...)``.

Each op takes a batch ``x`` of images ``[N, C, H, W]`` (``uint8`` in [0, 255], or a
float dtype in [0, 1]) and the unit's ``torch.Generator``, and draws every random
number from that generator alone: the parameters of all ``N`` images in one call,
then the op on the whole batch at once. So an augmented search stays bitwise
reproducible, and no Python loop runs over the images.

    train_transform=Compose(RandomResizedCrop(32), RandomHorizontalFlip(),
                            ColorJitter(0.4, 0.4, 0.4), Normalize(MEAN, STD))

``Compose`` is called as ``(x, y, generator)`` (a ``train_transform``) or as ``(x, y)``
(an ``eval_transform``: then only ops without randomness may be in it). The crop,
the flip and the jitter keep the dtype (a ``uint8`` batch is rounded back);
``Normalize`` returns floats, scaling a ``uint8`` batch to [0, 1] first.
The functions (``random_resized_crop``, ...) are the same ops called directly.
Arguments are checked when an op is built.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "Compose",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "ColorJitter",
    "Normalize",
    "random_resized_crop",
    "random_horizontal_flip",
    "color_jitter",
    "normalize",
]

_ATTEMPTS = 10  # torchvision's RandomResizedCrop tries 10 boxes before its central fallback
_GREY = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, as torchvision's rgb_to_grayscale


# ------------------------------------------------------------------ checks
def _size(size: int | Sequence[int]) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in pair):
        raise ValueError(f"size is {size!r}, but must be an int >= 1 or a pair (height, width) of them")
    return pair[0], pair[1]


def _scale_ratio(scale: Sequence[float], ratio: Sequence[float]) -> tuple[tuple[float, float], tuple[float, float]]:
    s, r = tuple(float(v) for v in scale), tuple(float(v) for v in ratio)
    if len(s) != 2 or not 0 < s[0] <= s[1] <= 1:
        raise ValueError(f"scale is {scale!r}, but must be (low, high) with 0 < low <= high <= 1")
    if len(r) != 2 or not 0 < r[0] <= r[1] or not all(math.isfinite(v) for v in r):
        raise ValueError(f"ratio is {ratio!r}, but must be (low, high) with 0 < low <= high, finite")
    return (s[0], s[1]), (r[0], r[1])


def _probability(p: float) -> float:
    if not 0 <= p <= 1:
        raise ValueError(f"p is {p!r}, but must be a probability in [0, 1]")
    return float(p)


def _strength(name: str, value: float) -> float:
    if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
        raise ValueError(f"{name} is {value!r}, but must be a finite number >= 0 (0: leave {name} as it is)")
    return float(value)


def _stats(mean: float | Sequence[float], std: float | Sequence[float]) -> tuple[tuple[float, ...], ...]:
    m = (float(mean),) if isinstance(mean, (int, float)) else tuple(float(v) for v in mean)
    s = (float(std),) if isinstance(std, (int, float)) else tuple(float(v) for v in std)
    if not all(v > 0 and math.isfinite(v) for v in s) or not s:
        raise ValueError(f"std is {std!r}, but every std must be a finite number > 0")
    if not m or not all(math.isfinite(v) for v in m):
        raise ValueError(f"mean is {mean!r}, but must be finite numbers")
    if len(m) != len(s) and 1 not in (len(m), len(s)):
        raise ValueError(f"mean is {mean!r} and std is {std!r}, but they must have one value per channel each")
    return m, s


def _images(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{what} takes a batch of images [N, C, H, W], but got {shape}")
    if x.dtype != torch.uint8 and not x.is_floating_point():
        raise ValueError(f"{what} takes uint8 or floating-point images, but got {x.dtype}")


def _uniform(generator: torch.Generator, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) numbers drawn on the generator's device in one call, then moved to ``device``."""
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"a random op needs a torch.Generator, but got {generator!r}")
    return torch.rand(shape, generator=generator, device=generator.device).to(device)


def _to_float(x: torch.Tensor) -> torch.Tensor:
    return x.float() / 255 if x.dtype == torch.uint8 else x


def _like(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out`` (floats) in ``x``'s dtype: a uint8 batch scaled back and rounded."""
    return (out * 255).round().clamp(0, 255).to(torch.uint8) if x.dtype == torch.uint8 else out


# ------------------------------------------------------------------ the ops as functions
def random_resized_crop(
    x: torch.Tensor,
    size: int | Sequence[int],
    generator: torch.Generator,
    scale: Sequence[float] = (0.08, 1.0),
    ratio: Sequence[float] = (3 / 4, 4 / 3),
) -> torch.Tensor:
    """Each image's random box (area a ``scale`` fraction of the image, aspect ``ratio``,
    log-uniform), resized to ``size`` bilinearly: torchvision's RandomResizedCrop, with
    its 10 tries and central fallback, for all images at once (``grid_sample`` on
    per-image affine grids; no antialiasing)."""
    (oh, ow), ((s0, s1), (r0, r1)) = _size(size), _scale_ratio(scale, ratio)
    _images(x, "random_resized_crop")
    n, _, h, w = x.shape
    u = _uniform(generator, (n, _ATTEMPTS, 4), x.device).double()
    area = h * w * (s0 + (s1 - s0) * u[..., 0])
    aspect = torch.exp(math.log(r0) + (math.log(r1) - math.log(r0)) * u[..., 1])
    cw, ch = torch.sqrt(area * aspect).round(), torch.sqrt(area / aspect).round()
    ok = (cw >= 1) & (cw <= w) & (ch >= 1) & (ch <= h)
    first = torch.where(ok.any(1), ok.int().argmax(1), 0)[:, None]
    pick = lambda t: t.gather(1, first)[:, 0]  # noqa: E731
    cw, ch = pick(cw), pick(ch)
    top, left = (pick(u[..., 2]) * (h - ch + 1)).floor(), (pick(u[..., 3]) * (w - cw + 1)).floor()
    # The fallback where no try fits: the central box of the largest area within ratio.
    if w / h < r0:
        fw, fh = float(w), float(round(w / r0))
    elif w / h > r1:
        fw, fh = float(round(h * r1)), float(h)
    else:
        fw, fh = float(w), float(h)
    miss = ~ok.any(1)
    cw, ch = torch.where(miss, fw, cw), torch.where(miss, fh, ch)
    top, left = torch.where(miss, float((h - fh) // 2), top), torch.where(miss, float((w - fw) // 2), left)
    theta = torch.zeros(n, 2, 3, dtype=torch.float64, device=x.device)
    theta[:, 0, 0], theta[:, 0, 2] = cw / w, (2 * left + cw) / w - 1
    theta[:, 1, 1], theta[:, 1, 2] = ch / h, (2 * top + ch) / h - 1
    xf = _to_float(x)
    grid = F.affine_grid(theta.to(xf.dtype), [n, x.shape[1], oh, ow], align_corners=False)
    out = F.grid_sample(xf, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return _like(out, x)


def random_horizontal_flip(x: torch.Tensor, generator: torch.Generator, p: float = 0.5) -> torch.Tensor:
    """Each image mirrored left to right with probability ``p``."""
    p = _probability(p)
    _images(x, "random_horizontal_flip")
    flip = _uniform(generator, (len(x),), x.device) < p
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


def _grey(x: torch.Tensor) -> torch.Tensor:
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(1)
    return (_GREY[0] * r + _GREY[1] * g + _GREY[2] * b)[:, None]


def color_jitter(
    x: torch.Tensor, generator: torch.Generator, brightness: float = 0, contrast: float = 0, saturation: float = 0
) -> torch.Tensor:
    """Each image's brightness, contrast and saturation scaled by factors drawn uniformly
    from ``[max(0, 1 - v), 1 + v]``, in that order (torchvision's ColorJitter blends, in
    a fixed order), clamped to the range. Saturation needs RGB images (3 channels)."""
    strengths = [
        _strength(k, v) for k, v in (("brightness", brightness), ("contrast", contrast), ("saturation", saturation))
    ]
    _images(x, "color_jitter")
    if strengths[2] and x.shape[1] != 3:
        raise ValueError(f"color_jitter's saturation needs RGB images (3 channels), but got {x.shape[1]}")
    u = _uniform(generator, (len(x), 3), x.device)  # all three always drawn: one stream whatever is set
    lo = torch.tensor([max(0.0, 1 - v) for v in strengths], device=x.device)
    factors = (lo + (torch.tensor([1 + v for v in strengths], device=x.device) - lo) * u)[:, :, None, None, None]
    out = _to_float(x)
    factors = factors.to(out.dtype)
    if strengths[0]:
        out = (out * factors[:, 0]).clamp(0, 1)
    if strengths[1]:
        mean = _grey(out).mean(dim=(1, 2, 3), keepdim=True)
        out = (factors[:, 1] * out + (1 - factors[:, 1]) * mean).clamp(0, 1)
    if strengths[2]:
        out = (factors[:, 2] * out + (1 - factors[:, 2]) * _grey(out)).clamp(0, 1)
    return _like(out, x)


def normalize(x: torch.Tensor, mean: float | Sequence[float], std: float | Sequence[float]) -> torch.Tensor:
    """``(x - mean) / std`` per channel, in floats (a uint8 batch scaled to [0, 1] first)."""
    m, s = _stats(mean, std)
    _images(x, "normalize")
    xf = _to_float(x)
    for name, values in (("mean", m), ("std", s)):
        if len(values) not in (1, x.shape[1]):
            raise ValueError(f"{name} has {len(values)} values, but the images have {x.shape[1]} channels")
    shape = (1, -1, 1, 1)
    return (xf - torch.tensor(m, dtype=xf.dtype, device=x.device).view(shape)) / torch.tensor(
        s, dtype=xf.dtype, device=x.device
    ).view(shape)


# ------------------------------------------------------------------ the ops as steps of a Compose
class RandomResizedCrop:
    """``random_resized_crop`` as a step: ``RandomResizedCrop(32)(x, generator)``."""

    random = True

    def __init__(
        self, size: int | Sequence[int], scale: Sequence[float] = (0.08, 1.0), ratio: Sequence[float] = (3 / 4, 4 / 3)
    ) -> None:
        self.size = _size(size)
        self.scale, self.ratio = _scale_ratio(scale, ratio)

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return random_resized_crop(x, self.size, generator, self.scale, self.ratio)

    def __repr__(self) -> str:
        return f"RandomResizedCrop(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip:
    """``random_horizontal_flip`` as a step."""

    random = True

    def __init__(self, p: float = 0.5) -> None:
        self.p = _probability(p)

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return random_horizontal_flip(x, generator, self.p)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class ColorJitter:
    """``color_jitter`` as a step."""

    random = True

    def __init__(self, brightness: float = 0, contrast: float = 0, saturation: float = 0) -> None:
        self.brightness = _strength("brightness", brightness)
        self.contrast = _strength("contrast", contrast)
        self.saturation = _strength("saturation", saturation)

    def __call__(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return color_jitter(x, generator, self.brightness, self.contrast, self.saturation)

    def __repr__(self) -> str:
        return f"ColorJitter(brightness={self.brightness}, contrast={self.contrast}, saturation={self.saturation})"


class Normalize:
    """``normalize`` as a step (no randomness: it may be in an ``eval_transform``)."""

    random = False

    def __init__(self, mean: float | Sequence[float], std: float | Sequence[float]) -> None:
        self.mean, self.std = _stats(mean, std)

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return normalize(x, self.mean, self.std)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"


class Compose:
    """Steps ``(x, generator) -> x`` applied in order to the images, the labels passed through.

    ``Compose(...)(x, y, generator)`` is a ``train_transform``; ``Compose(...)(x, y)`` an
    ``eval_transform``, where a random step is refused. A step may be any callable
    ``(x, generator) -> x``; one without a ``random = False`` attribute counts as random.
    """

    def __init__(self, *steps: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        for step in steps:
            if not callable(step):
                raise ValueError(f"Compose's step {step!r} is not callable, but each must be (x, generator) -> x")
        self.steps = steps

    def __call__(self, x: torch.Tensor, y: Any, generator: torch.Generator | None = None) -> tuple[torch.Tensor, Any]:
        if generator is None:
            random = [s for s in self.steps if getattr(s, "random", True)]
            if random:
                raise ValueError(
                    f"{random[0]!r} is random, but Compose was called without a generator "
                    "(as an eval_transform); use only steps without randomness there"
                )
        for step in self.steps:
            x = step(x, generator)
        return x, y

    def __repr__(self) -> str:
        return f"Compose({', '.join(map(repr, self.steps))})"
