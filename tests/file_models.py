"""Image files for the file-source tests: class folders and WebDataset-style tar shards
written with PIL and tarfile, and a tiny CNN spec; cloudpickle sends it to Dask
workers by value."""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path

import cloudpickle
import numpy as np
import torch
from torch import nn

from cerebro_automl import TrainingSpec, accuracy

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIZE = 12
CLASSES = ("zebra", "ant", "moose")  # sorted: ant 0, moose 1, zebra 2


def image(label: int, rng: np.random.Generator, size: int = SIZE) -> np.ndarray:
    """An RGB image whose channel ``label`` is brighter: a class a CNN learns in an epoch."""
    pixels = rng.integers(0, 120, (size, size, 3))
    pixels[:, :, label % 3] += 120
    return pixels.astype(np.uint8)


def png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def write_folder(root: Path, per_class: int = 20, classes=CLASSES, seed: int = 0, ext: str = "png") -> Path:
    """``root/<class>/<n>.<ext>``, lossless by default; returns ``root``."""
    rng = np.random.default_rng(seed)
    index = {c: i for i, c in enumerate(sorted(classes))}
    for c in classes:
        (root / c).mkdir(parents=True)
        for n in range(per_class):
            fmt = "JPEG" if ext == "jpg" else "PNG"
            (root / c / f"{n:03d}.{ext}").write_bytes(png(image(index[c], rng), fmt))
    return root


def write_originals(root: Path, per_class: int = 8, seed: int = 0, same: bool = False) -> Path:
    """``root/<class>/<n>.jpg``: JPEGs of random sizes (14 to 24 pixels a side), as full-size
    originals are; ``same=True`` writes one image everywhere (so only the crops differ)."""
    rng = np.random.default_rng(seed)
    one = png(image(0, rng, 20), "JPEG")
    for label, c in enumerate(sorted(CLASSES)):
        (root / c).mkdir(parents=True)
        for n in range(per_class):
            h, w = (int(v) for v in rng.integers(14, 25, 2))
            pixels = np.resize(image(label, rng, max(h, w)), (h, w, 3)).astype(np.uint8)
            (root / c / f"{n:03d}.jpg").write_bytes(one if same else png(pixels, "JPEG"))
    return root


def to_tensor(image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image).transpose(2, 0, 1).copy())


def random_crop(image, generator, size: int = 8) -> torch.Tensor:
    """A random resized crop of the original and a random flip, drawn from ``generator``
    (a plain-PIL RandomResizedCrop): the per-item random_transform."""
    from PIL import Image

    w, h = image.size
    side = int(torch.randint(min(w, h) // 2, min(w, h) + 1, (1,), generator=generator))
    left = int(torch.randint(0, w - side + 1, (1,), generator=generator))
    top = int(torch.randint(0, h - side + 1, (1,), generator=generator))
    out = image.resize((size, size), box=(left, top, left + side, top + side))
    if bool(torch.rand(1, generator=generator) < 0.5):
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return to_tensor(out)


def center_crop(image, size: int = 8) -> torch.Tensor:
    """The deterministic transform: the central square, resized."""
    w, h = image.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    return to_tensor(image.resize((size, size), box=(left, top, left + side, top + side)))


def write_shards(folder: Path, shards: int = 4, per_shard: int = 15, seed: int = 0, label: str = "cls",
                 prefix: str = "train", drop_label: tuple[int, int] | None = None, by_class: bool = False) -> list[str]:
    """``folder/<prefix>-<k>.tar``, each ``per_shard`` samples ``<key>.png`` + ``<key>.<label>``;
    ``drop_label=(shard, sample)`` leaves that sample without its label; ``by_class``: shard
    k holds class k % 3 only, as a dataset exported class by class."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(shards):
        path = folder / f"{prefix}-{k:03d}.tar"
        with tarfile.open(path, "w") as tar:
            for n in range(per_shard):
                cls = k % 3 if by_class else int(rng.integers(0, 3))
                key = f"{k:03d}{n:04d}"
                text = {"cls": str(cls), "txt": f"{cls}\n", "json": f'{{"label": {cls}, "w": 1}}'}[label]
                members = [("png", png(image(cls, rng)))]
                if (k, n) != drop_label:
                    members.append((label, text.encode()))
                for ext, data in members:
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def cnn(config):
    w = config["width"]
    return nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(4 * w, 3))


def normalise(x, y):
    return x.float() / 255 - 0.5, y


def flip(x, y, generator):
    """A seeded horizontal flip per image, on the batch: the spec's augmentation hook."""
    x, y = normalise(x, y)
    mask = torch.rand(len(x), generator=generator, device=x.device) < 0.5
    return torch.where(mask[:, None, None, None], x.flip(-1), x), y


def cnn_spec() -> TrainingSpec:
    return TrainingSpec(model_fn=cnn, optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                        loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy},
                        batch_size=8, train_transform=flip, eval_transform=normalise)


def files_in(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


ONE_CONFIG = ({"lr": 1e-2, "width": 4},)


def train_files(data, client=None, epochs: int = 2, configs=ONE_CONFIG, **session):
    """``(history, final weights)`` of ``configs`` trained on ``data`` with cnn_spec, on
    the local executor or on ``client``'s cluster; every model must train."""
    from cerebro_automl import Session

    where = {"client": client} if client is not None else {"executor": "local"}
    with Session(cnn_spec(), data, seed=4, progress=False, **where, **session) as s:
        ids = [s.add(dict(c), epochs=epochs) for c in configs]
        history = s.run()
        assert [s.model(i).error for i in ids] == [None] * len(ids)
        return history, [s.model(i).state()["model"] for i in ids]


def assert_same_runs(a, b) -> None:
    """Two ``train_files`` results are the same bits: weights and the history's figures."""
    (ha, wa), (hb, wb) = a, b
    for x, y in zip(wa, wb, strict=True):
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    cols = ["train_loss", "val_loss", "val_accuracy"]
    ha, hb = (h.sort_values(["model_id", "epoch"]).reset_index(drop=True) for h in (ha, hb))
    assert ha[cols].equals(hb[cols])
