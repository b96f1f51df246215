import os
import tempfile

import numpy as np
import pandas as pd

from cerebro_automl import PartitionedDataset

folder = tempfile.mkdtemp()
rng = np.random.default_rng(0)
for day in range(2):
    frame = pd.DataFrame({f"I{i}": rng.normal(size=32).astype("float32") for i in range(1, 14)})
    frame = frame.assign(**{f"C{i}": rng.integers(0, 100, size=32) for i in range(1, 27)})
    frame["click"] = rng.integers(0, 2, size=32)
    frame.to_parquet(os.path.join(folder, f"day-{day}.parquet"), row_group_size=8)
url = f"file://{folder}"
# --8<-- [start:parquet]
data = PartitionedDataset.from_parquet(f"{url}/day-*.parquet",       # "s3://bucket/criteo/day-*.parquet"
                                       features={"dense": [f"I{i}" for i in range(1, 14)],
                                                 "cat": [f"C{i}" for i in range(1, 27)]},
                                       label="click", num_partitions=2, valid_fraction=0.25,
                                       shuffle_seed=0, storage_options={})  # e.g. {"anon": False} for s3fs
# --8<-- [end:parquet]
assert data.num_rows == 64
