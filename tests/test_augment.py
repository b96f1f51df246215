"""cerebro_automl.augment: seeded, batched augmentation ops on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cerebro_automl import PartitionedDataset, Session, TrainingSpec
from cerebro_automl.augment import (
    ColorJitter,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    color_jitter,
    normalize,
    random_horizontal_flip,
    random_resized_crop,
)

MEAN, STD = (0.5, 0.4, 0.3), (0.25, 0.2, 0.3)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _images(n: int = 16, c: int = 3, h: int = 24, w: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=_gen(seed))


def _pipeline() -> Compose:
    return Compose(RandomResizedCrop(16), RandomHorizontalFlip(), ColorJitter(0.4, 0.4, 0.4), Normalize(MEAN, STD))


OPS = {
    "crop": lambda x, g: random_resized_crop(x, 16, g),
    "flip": random_horizontal_flip,
    "jitter": lambda x, g: color_jitter(x, g, 0.4, 0.4, 0.4),
    "pipeline": lambda x, g: _pipeline()(x, None, g)[0],
}


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_same_seed_same_bytes_other_seed_other_bytes(name, dtype):
    x = _images()
    x = x if dtype == torch.uint8 else x.float() / 255
    a, b, c = (OPS[name](x, _gen(s)) for s in (1, 1, 2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_ops_draw_only_from_the_generator():
    x = _images()
    torch.manual_seed(0)
    a = _pipeline()(x, None, _gen(3))[0]
    torch.manual_seed(1)  # torch's global generator moved elsewhere: nothing changes
    b = _pipeline()(x, None, _gen(3))[0]
    assert torch.equal(a, b)
    state = torch.random.get_rng_state()
    _pipeline()(x, None, _gen(3))
    assert torch.equal(state, torch.random.get_rng_state())


def test_each_image_of_a_batch_gets_its_own_parameters():
    one = _images(1)
    x = one.expand(32, -1, -1, -1).contiguous()  # 32 copies of one image
    for name in ("crop", "jitter", "pipeline"):
        out = OPS[name](x, _gen(0))
        distinct = {out[i].numpy().tobytes() for i in range(len(out))}
        assert len(distinct) > 16, name
    flipped = random_horizontal_flip(x, _gen(0))
    is_flipped = [torch.equal(f, one[0].flip(-1)) for f in flipped]
    assert 0 < sum(is_flipped) < 32
    assert all(f or torch.equal(o, one[0]) for f, o in zip(is_flipped, flipped, strict=True))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.float64])
def test_shapes_dtypes_and_ranges(dtype):
    x = _images(8, 3, 20, 30)
    x = x if dtype == torch.uint8 else x.to(dtype) / 255
    crop = random_resized_crop(x, (12, 18), _gen(0))
    assert crop.shape == (8, 3, 12, 18) and crop.dtype == dtype
    assert random_resized_crop(x, 40, _gen(0)).shape == (8, 3, 40, 40)  # upsampling too
    assert random_horizontal_flip(x, _gen(0)).dtype == dtype
    jittered = color_jitter(x, _gen(0), 0.9, 0.9, 0.9)
    assert jittered.shape == x.shape and jittered.dtype == dtype
    for out in (crop, jittered):
        top = 255 if dtype == torch.uint8 else 1
        assert out.min() >= 0 and out.max() <= top
    normed = normalize(x, MEAN, STD)
    assert normed.dtype == (torch.float32 if dtype == torch.uint8 else dtype)


def test_a_flip_with_p_1_mirrors_every_image_and_p_0_none():
    x = _images()
    assert torch.equal(random_horizontal_flip(x, _gen(0), p=1.0), x.flip(-1))
    assert torch.equal(random_horizontal_flip(x, _gen(0), p=0.0), x)


def test_normalize_is_the_formula():
    x = _images(4)
    want = (x.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    torch.testing.assert_close(normalize(x, MEAN, STD), want)
    xf = torch.rand(4, 1, 5, 5, generator=_gen(0))
    torch.testing.assert_close(Normalize(0.5, 0.25)(xf), (xf - 0.5) / 0.25)
    with pytest.raises(ValueError, match="mean has 2 values, but the images have 3 channels"):
        normalize(x, (0.5, 0.5), 0.2)


@pytest.mark.parametrize("size", [10, 24, 37])
def test_a_crop_of_the_whole_square_image_is_its_resize(size):
    x = _images(6, 3, 24, 24).float() / 255
    out = random_resized_crop(x, size, _gen(0), scale=(1, 1), ratio=(1, 1))
    want = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_where_no_box_fits_the_crop_is_the_central_one_within_the_ratio():
    x = _images(4, 3, 24, 24).float() / 255
    out = random_resized_crop(x, (6, 12), _gen(0), scale=(1, 1), ratio=(2, 2))  # 34 x 17 never fits
    want = F.interpolate(x[:, :, 6:18, :], size=(6, 12), mode="bilinear", align_corners=False)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


def test_a_crop_at_the_size_of_its_box_is_that_part_of_the_image():
    x = torch.arange(64 * 64, dtype=torch.float32).view(1, 1, 64, 64)  # each pixel names its place
    out = random_resized_crop(x.expand(40, -1, -1, -1), 32, _gen(0), scale=(0.25, 0.25), ratio=(1, 1))
    places = set()
    for crop in out:
        top, left = divmod(int(crop[0, 0, 0].round()), 64)
        places.add((top, left))
        torch.testing.assert_close(crop, x[0, :, top:top + 32, left:left + 32], atol=1e-2, rtol=0)
    assert len(places) > 30


def test_a_crop_lies_inside_the_image_and_keeps_its_ratio_range():
    # A horizontal ramp: a crop's columns show where its box lies.
    x = torch.linspace(0, 1, 64).expand(200, 1, 64, 64).contiguous()
    out = random_resized_crop(x, 64, _gen(0), scale=(0.1, 0.3))
    left, right = out[:, 0, 0, 0], out[:, 0, 0, -1]
    assert (left >= 0).all() and (right <= 1).all()
    width = right - left  # about the box's width over the image's
    assert width.min() > 0.1 and width.max() < 0.7
    assert len(set(left.tolist())) > 100  # boxes in many places


def test_jitter_of_strength_zero_is_the_identity_and_brightness_scales():
    x = torch.rand(8, 3, 6, 6, generator=_gen(0)) * 0.5
    assert torch.equal(color_jitter(x, _gen(1)), x)
    out = color_jitter(x, _gen(1), brightness=0.5)
    ratio = out / x
    per_image = ratio.flatten(1)
    torch.testing.assert_close(per_image, per_image[:, :1].expand_as(per_image))  # one factor per image
    assert per_image[:, 0].min() >= 0.5 - 1e-6 and per_image[:, 0].max() <= 1.5 + 1e-6
    assert per_image[:, 0].std() > 0.05  # and its own factor
    grey = color_jitter(x, _gen(1), saturation=1.0)
    assert not torch.equal(grey, x)


def _grey(x):
    return (0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2])[:, None]


@pytest.mark.parametrize("which", ["contrast", "saturation"])
def test_contrast_and_saturation_scale_each_image_away_from_its_grey(which):
    x = 0.4 + 0.2 * torch.rand(16, 3, 6, 6, generator=_gen(0))  # no clamping at 1 +- 0.5
    out = color_jitter(x, _gen(1), **{which: 0.5})
    grey = _grey(x).mean(dim=(1, 2, 3), keepdim=True) if which == "contrast" else _grey(x)
    factor = ((out - grey) / (x - grey)).flatten(1)
    torch.testing.assert_close(factor, factor[:, :1].expand_as(factor), atol=1e-3, rtol=1e-3)
    assert factor.min() >= 0.5 - 1e-3 and factor.max() <= 1.5 + 1e-3 and factor[:, 0].std() > 0.05


def test_compose_as_eval_transform_refuses_random_steps():
    x = _images(2)
    out, y = Compose(Normalize(0.5, 0.25))(x, "labels")
    assert y == "labels" and out.dtype == torch.float32
    with pytest.raises(ValueError, match="is random, but Compose was called without a generator"):
        _pipeline()(x, None)


@pytest.mark.parametrize("build, message", [
    (lambda: RandomResizedCrop(0), "size is 0, but must be an int >= 1"),
    (lambda: RandomResizedCrop((8, -1)), r"size is \(8, -1\)"),
    (lambda: RandomResizedCrop(8, scale=(0, 1)), r"scale is \(0, 1\), but must be \(low, high\) with 0 < low"),
    (lambda: RandomResizedCrop(8, scale=(0.5, 1.5)), r"scale is \(0.5, 1.5\)"),
    (lambda: RandomResizedCrop(8, scale=(0.9, 0.5)), r"low <= high"),
    (lambda: RandomResizedCrop(8, ratio=(-1, 1)), r"ratio is \(-1, 1\)"),
    (lambda: RandomHorizontalFlip(1.5), r"p is 1.5, but must be a probability in \[0, 1\]"),
    (lambda: RandomHorizontalFlip(-0.1), r"p is -0.1"),
    (lambda: ColorJitter(brightness=-0.2), "brightness is -0.2, but must be a finite number >= 0"),
    (lambda: ColorJitter(contrast=float("nan")), "contrast is nan"),
    (lambda: ColorJitter(saturation=-1), "saturation is -1"),
    (lambda: Normalize(0.5, 0), "std is 0, but every std must be a finite number > 0"),
    (lambda: Normalize([0.5] * 3, [0.2] * 2), r"mean is \[0.5, 0.5, 0.5\] and std is \[0.2, 0.2\], but they must have one value per"),
    (lambda: Compose(RandomHorizontalFlip(), 3), "Compose's step 3 is not callable"),
    (lambda: random_horizontal_flip(_images(), _gen(0), p=2), "p is 2"),
    (lambda: random_resized_crop(_images()[0], 8, _gen(0)), r"batch of images \[N, C, H, W\], but got \(3, 24, 24\)"),
    (lambda: color_jitter(_images(c=1), _gen(0), saturation=0.5), "saturation needs RGB images"),
])
def test_bad_arguments_are_refused_with_the_value_and_the_rule(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_random_op_without_a_generator_is_refused():
    with pytest.raises(TypeError, match=r"needs a torch\.Generator"):
        RandomHorizontalFlip()(_images(), None)


def _search() -> list[dict]:
    images = np.random.default_rng(0).integers(0, 256, size=(48, 3, 12, 12), dtype=np.uint8)
    data = PartitionedDataset.from_arrays(images, np.arange(48) % 2, num_partitions=2, valid_fraction=0.25)
    spec = TrainingSpec(
        model_fn=lambda c: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2)),
        optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=c["lr"]),
        loss_fn=F.cross_entropy, batch_size=8,
        train_transform=Compose(RandomResizedCrop(8, scale=(0.5, 1)), RandomHorizontalFlip(),
                                ColorJitter(0.3, 0.3, 0.3), Normalize(MEAN, STD)),
        eval_transform=lambda x, y: (normalize(F.interpolate(x.float() / 255, size=8), MEAN, STD), y),
    )
    with Session(spec, data, executor="local", seed=3) as s:
        ids = [s.add({"lr": lr}, epochs=2) for lr in (0.05, 0.1)]
        s.run()
        assert [s.model(i).error for i in ids] == [None, None]
        return [s.model(i).state()["model"] for i in ids]


def test_a_local_search_with_augmentation_gives_the_same_weights_twice():
    a, b = _search(), _search()
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k
    assert not torch.equal(a[0]["1.weight"], a[1]["1.weight"])
