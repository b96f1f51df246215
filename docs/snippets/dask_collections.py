import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd

from cerebro_automl import PartitionedDataset, Session
from tiny import spec

# --8<-- [start:dask]
X = da.random.default_rng(0).normal(size=(96, 40), chunks=(24, 40)).astype("float32")
y = (X[:, 0] > 0).astype("int64")
data = PartitionedDataset.from_dask(X, y, num_partitions=2, valid_fraction=0.25, shuffle_seed=0)

frame = dd.from_pandas(pd.DataFrame({"a": np.arange(96.0), "b": np.ones(96), "label": np.arange(96) % 3}),
                       npartitions=4)
table = PartitionedDataset.from_dask(frame, features=["a", "b"], label="label", num_partitions=2)
# --8<-- [end:dask]
with Session(spec, data, executor="local") as s:
    s.add({"lr": 1e-3, "width": 8}, epochs=1)
    s.run()
    assert s.status(0) == "paused"
