"""Optuna tunes a small CNN on a folder of PNG images, with random-crop and flip augmentation.

    python examples/image_folder_augment.py [--trials 8] [--epochs 8] [--images 900]

The images are drawn locally (circles, squares and triangles in random colours
and places, with noise), since nothing can be downloaded here. Each Dask worker
builds the image-folder Dataset itself and decodes PNGs (with PIL) for the
batches of its own partition; the driver never reads a pixel. Augmentation (a
random resized crop and a flip, from ``cerebro_automl.augment``) is a
``train_transform`` that runs per batch on the worker's device with the unit's
seeded generator, so an augmented search is bitwise reproducible.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import Counter
from functools import partial
from typing import Any, Mapping

import cloudpickle
import numpy as np
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.augment import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop

# Workers started elsewhere need not have this folder on their path: send by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

CLASSES = ("circle", "square", "triangle")
SIZE = 32
MEAN, STD = 0.5, 0.25


def make_image_folder(root: str, images: int, seed: int = 0) -> str:
    """Write ``images`` PNGs as ``root/<class>/<n>.png``; returns ``root``."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    for name in CLASSES:
        os.makedirs(os.path.join(root, name), exist_ok=True)
    for n in range(images):
        label = CLASSES[n % len(CLASSES)]
        background = tuple(int(v) for v in rng.integers(0, 256, 3))
        image = Image.new("RGB", (SIZE, SIZE), background)
        draw = ImageDraw.Draw(image)
        r = int(rng.integers(6, 12))
        cx, cy = (int(v) for v in rng.integers(r, SIZE - r, 2))
        colour = tuple(int(255 - v) for v in background)  # contrasting
        box = (cx - r, cy - r, cx + r, cy + r)
        if label == "circle":
            draw.ellipse(box, fill=colour)
        elif label == "square":
            draw.rectangle(box, fill=colour)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
        pixels = np.asarray(image).astype(np.int16) + rng.integers(-20, 21, (SIZE, SIZE, 3))
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(os.path.join(root, label, f"{n}.png"))
    return root


class ImageFolder(torch.utils.data.Dataset):
    """``root/<class>/*.png`` as ``(uint8 image [3, H, W], class index)``, decoded per item."""

    def __init__(self, root: str) -> None:
        self.files = [(os.path.join(root, c, f), i) for i, c in enumerate(CLASSES)
                      for f in sorted(os.listdir(os.path.join(root, c)), key=lambda f: int(f[:-4]))]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.files[index]
        with Image.open(path) as image:
            pixels = torch.from_numpy(np.array(image.convert("RGB")))
        return pixels.permute(2, 0, 1).contiguous(), label


# Seeded, batched augmentation on the worker's device (cerebro_automl.augment): every
# image of a batch gets its own crop box and flip, all drawn from the unit's generator.
augment = Compose(RandomResizedCrop(SIZE, scale=(0.6, 1.0)), RandomHorizontalFlip(), Normalize(MEAN, STD))
normalise = Compose(Normalize(MEAN, STD))  # validation: no randomness


def model_fn(config: Mapping[str, Any]) -> nn.Module:
    w = config["width"]
    return nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * w * (SIZE // 4) ** 2, len(CLASSES)))


def optimizer_fn(config: Mapping[str, Any], params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=config["lr"])


def make_spec() -> TrainingSpec:
    return TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                        loss_fn=nn.functional.cross_entropy, metrics={"accuracy": accuracy},
                        batch_size="batch_size", train_transform=augment, eval_transform=normalise)


def make_data(root: str, num_partitions: int, cache: str | None = None) -> PartitionedDataset:
    """Train images partitioned by a seeded shuffle; each worker builds its own Dataset."""
    return PartitionedDataset.from_torch(partial(ImageFolder, os.path.join(root, "train")), num_partitions,
                                         valid_fn=partial(ImageFolder, os.path.join(root, "valid")),
                                         shuffle_seed=0, cache=cache)


def space(trial: Any) -> dict:
    return {"lr": trial.suggest_float("lr", 3e-4, 3e-2, log=True),
            "width": trial.suggest_categorical("width", [8, 16]),
            "batch_size": trial.suggest_categorical("batch_size", [16, 32])}


def main() -> None:
    import tempfile

    import optuna

    from cerebro_automl.adapters.optuna import optimize

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--images", type=int, default=900, help="training images (a fifth more for validation)")
    parser.add_argument("--workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--folder", default=None, help="where to write the images (default: a temporary folder)")
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    root = args.folder or tempfile.mkdtemp(prefix="cerebro-images-")
    make_image_folder(os.path.join(root, "train"), args.images, seed=0)
    make_image_folder(os.path.join(root, "valid"), args.images // 5, seed=1)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1))
    started = time.perf_counter()
    optimize(study, make_spec(), make_data(root, args.partitions), space, n_trials=args.trials,
             epochs=args.epochs, metric="val_accuracy", n_workers=args.workers)
    wall = time.perf_counter() - started
    states = Counter(t.state.name.lower() for t in study.trials)
    print(f"\n{len(study.trials)} trials on {args.images} PNG images ({args.images // 5} for validation) "
          f"in {root}: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    for t in sorted((t for t in study.trials if t.value is not None), key=lambda t: -t.value)[:3]:
        print(f"  #{t.number:<3} val_accuracy {t.value:.3f}  {t.params}  ({t.state.name.lower()})")
    print(f"{wall:.0f} s on {args.workers or 'all'} workers, cluster start included")


if __name__ == "__main__":
    main()
