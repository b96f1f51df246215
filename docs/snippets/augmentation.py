import numpy as np
import torch

from cerebro_automl import PartitionedDataset, Session, TrainingSpec

images = np.random.default_rng(0).integers(0, 256, size=(32, 1, 8, 8), dtype=np.uint8)
labels = np.arange(32) % 2
data = PartitionedDataset.from_arrays(images, labels, num_partitions=2, valid_fraction=0.25)
base = dict(model_fn=lambda c: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 2)),
            optimizer_fn=lambda c, p: torch.optim.SGD(p, lr=0.1),
            loss_fn=torch.nn.functional.cross_entropy, batch_size=8)
# --8<-- [start:augment]
from cerebro_automl.augment import Compose, Normalize, RandomHorizontalFlip, RandomResizedCrop

# Steps on the whole batch, on the worker's device, drawing only from the unit's generator.
augment = Compose(RandomResizedCrop(8, scale=(0.5, 1.0)), RandomHorizontalFlip(), Normalize(0.5, 0.25))

spec = TrainingSpec(**base, train_transform=augment,
                    eval_transform=Compose(Normalize(0.5, 0.25)))   # validation: no randomness
# --8<-- [end:augment]
with Session(spec, data, executor="local") as s:
    s.add({}, epochs=1)
    s.run()
    assert s.status(0) == "paused"
