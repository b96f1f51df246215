import tempfile

import numpy as np

from cerebro_automl import PartitionedDataset, Session
from tiny import spec


def read_partition(i):
    rng = np.random.default_rng(i)
    for _ in range(3):                               # chunks: a partition need not fit in memory
        x = rng.normal(size=(16, 40)).astype("float32")
        yield x, (x[:, 0] > 0).astype("int64")


# --8<-- [start:disk]
data = PartitionedDataset.from_loader(read_partition, num_partitions=2, valid_fraction=0.25,
                                      cache="disk", cache_dir=tempfile.mkdtemp())  # default: the worker's scratch folder
# --8<-- [end:disk]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-3, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"
