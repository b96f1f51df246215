import io
import math
import os
import tarfile
import tempfile

import numpy as np
import torch
from PIL import Image

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy

# A tiny image folder and the same images as tar shards (nothing is downloaded).
top = tempfile.mkdtemp()
rng = np.random.default_rng(0)
for split, count in (("train", 24), ("valid", 6)):
    for c, name in enumerate(("cat", "dog", "fox")):
        os.makedirs(f"{top}/{split}/{name}")
        for n in range(count // 3):
            pixels = rng.integers(0, 120, (16, 16, 3)).astype("uint8")
            pixels[:, :, c] += 120
            Image.fromarray(pixels).save(f"{top}/{split}/{name}/{n}.jpg")
os.makedirs(f"{top}/shards")
for k in range(4):
    with tarfile.open(f"{top}/shards/train-{k:05d}.tar", "w") as tar:
        for n in range(6):
            c = (k + n) % 3
            pixels = rng.integers(0, 120, (16, 16, 3)).astype("uint8")
            pixels[:, :, c] += 120
            jpg = io.BytesIO()
            Image.fromarray(pixels).save(jpg, "JPEG")
            for ext, data in (("jpg", jpg.getvalue()), ("cls", str(c).encode())):
                info = tarfile.TarInfo(f"{k:02d}{n:04d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
root = f"{top}/train"

# --8<-- [start:folder]
data = PartitionedDataset.from_image_folder(f"{top}/train", num_partitions=2,
                                            valid=f"{top}/valid")      # or valid_fraction=0.1
print(data.class_to_idx)                                            # {'cat': 0, 'dog': 1, 'fox': 2}
# --8<-- [end:folder]
assert data.class_to_idx == {"cat": 0, "dog": 1, "fox": 2}


# --8<-- [start:augment]
def normalise(x, y):                               # x: the batch, uint8 [B, 3, H, W], on the device
    return x.float() / 255 - 0.5, y


def flip(x, y, generator):                         # seeded from the unit's seed: runs stay reproducible
    x, y = normalise(x, y)
    mask = torch.rand(len(x), generator=generator, device=x.device) < 0.5
    return torch.where(mask[:, None, None, None], x.flip(-1), x), y


def cnn(config):
    return torch.nn.Sequential(torch.nn.Conv2d(3, config["width"], 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(config["width"], 3))


spec = TrainingSpec(model_fn=cnn, optimizer_fn=lambda c, p: torch.optim.Adam(p, lr=c["lr"]),
                    metrics={"accuracy": accuracy}, batch_size=8,
                    train_transform=flip, eval_transform=normalise)
# --8<-- [end:augment]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-2, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"

# --8<-- [start:resize]
def to_32(image):                                  # a PIL image (RGB) -> uint8 [3, 32, 32]
    image = image.resize((32, 32))                 # deterministic: random crops go in train_transform
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


data = PartitionedDataset.from_image_folder(root, num_partitions=2, valid_fraction=0.25, transform=to_32)
# --8<-- [end:resize]
assert data.resolve(2).sources[0].load().train.batch(torch.arange(2))[0].shape == (2, 3, 32, 32)

# --8<-- [start:crops]
def random_resized_crop(image, generator, size=32):    # a training item: a random part of the original
    w, h = image.size
    area = w * h * (0.25 + 0.75 * torch.rand(1, generator=generator).item())       # 25-100% of the image
    ratio = math.exp(math.log(3 / 4) + math.log(16 / 9) * torch.rand(1, generator=generator).item())
    cw, ch = min(w, round(math.sqrt(area * ratio))), min(h, round(math.sqrt(area / ratio)))
    left = int(torch.randint(0, w - cw + 1, (1,), generator=generator))
    top = int(torch.randint(0, h - ch + 1, (1,), generator=generator))
    image = image.resize((size, size), box=(left, top, left + cw, top + ch))
    if torch.rand(1, generator=generator).item() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.ascontiguousarray(np.asarray(image).transpose(2, 0, 1)))


def center_crop(image, size=32):                       # a validation item: deterministic
    w, h = image.size
    side = min(w, h)
    box = ((w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2)
    pixels = np.asarray(image.resize((size, size), box=box))
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


data = PartitionedDataset.from_image_folder(root, num_partitions=2, valid_fraction=0.25,
                                            transform=center_crop,                  # validation items
                                            random_transform=random_resized_crop,   # training items
                                            cache="memory")                         # keeps the JPEG bytes
# --8<-- [end:crops]
weights = []
for _ in range(2):                                     # the same search twice: the same crops, the same bits
    with Session(spec, data, executor="local", seed=1) as s:
        s.add({"lr": 1e-2, "width": 8}, epochs=2)
        s.run()
        weights.append(s.model(0).state()["model"])
assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

# --8<-- [start:threads]
data = PartitionedDataset.from_image_folder(root, num_partitions=2, valid_fraction=0.25, transform=to_32,
                                            decode_threads=4)   # per worker, besides the cores that train
# --8<-- [end:threads]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-2, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"

# --8<-- [start:shards]
data = PartitionedDataset.from_tar_shards(f"{top}/shards/train-*.tar", num_partitions=2,
                                          valid_fraction=0.2)   # labels: each sample's .cls member
# --8<-- [end:shards]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-2, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"

# --8<-- [start:disk]
data = PartitionedDataset.from_image_folder(root, num_partitions=2, valid_fraction=0.25, transform=to_32,
                                            cache="disk")   # decoded once, into each worker's local_directory
# --8<-- [end:disk]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-2, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"
