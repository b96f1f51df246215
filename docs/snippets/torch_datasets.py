import os
import sys
import tempfile

import torch

from cerebro_automl import PartitionedDataset, Session
from tiny import spec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))


class Noise(torch.utils.data.Dataset):             # stands for an ImageFolder: items read one by one
    def __init__(self, n: int = 64):
        self.x = torch.randn(n, 40, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.x[i, 0] > 0)


# --8<-- [start:torch]
from functools import partial

data = PartitionedDataset.from_torch(partial(Noise, 64), num_partitions=2,     # built on each worker
                                     valid_fn=partial(Noise, 16), shuffle_seed=0)
# --8<-- [end:torch]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-3, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"


class Readings(torch.utils.data.IterableDataset):  # stands for a WebDataset pipeline or an HF streaming dataset
    def __init__(self, n: int = 64):
        self.n = n

    def __iter__(self):                            # single items, sorted by class; no len()
        x = torch.randn(self.n, 40, generator=torch.Generator().manual_seed(1))
        labels = (x[:, 0] > 0).long()
        for i in labels.argsort(stable=True).tolist():
            yield x[i], int(labels[i])


# --8<-- [start:stream]
data = PartitionedDataset.from_torch(partial(Readings, 64), num_partitions=2,  # each worker reads it all
                                     valid_fn=partial(Readings, 16), cache="memory")
# --8<-- [end:stream]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-3, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"

from structured_models import FileDataModule as MyDataModule  # noqa: E402  (a DataModule with val_dataloader)

# --8<-- [start:datamodule]
data = PartitionedDataset.from_datamodule(MyDataModule(tempfile.mkdtemp()), num_partitions=2)
# --8<-- [end:datamodule]
assert data.has_validation
