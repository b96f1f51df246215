import numpy as np
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from tiny import data, spec  # the quickstart's: an MLP of config["width"], Adam at config["lr"]

# --8<-- [start:session]
from cerebro_automl import Session

with Session(spec, data, fuse=8, executor="local") as s:        # groups of up to 8
    for width in (32, 64):                                       # a group has one architecture
        for lr in (1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2, 3e-2, 5e-2):
            s.add({"lr": lr, "width": width}, epochs=3)          # 16 configs, fused by width
    history = s.run()                                            # one report per model-epoch
    best = s.best("val_accuracy", mode="max").build()            # a plain nn.Module
# --8<-- [end:session]
assert len(history) == 48 and set(history["fuse"]) == {8}
assert sum(len(g.members) for g in s._fusion.groups.values()) == 16  # 4 groups of 4 on 2 partitions

# --8<-- [start:grid_spec]
import numpy as np
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy

rng = np.random.default_rng(0)
X = rng.normal(size=(256, 40)).astype("float32")
y = (X[:, :5].sum(axis=1) > 0).astype("int64")
data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.25)


def model_fn(config):
    return nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2))


def optimizer_fn(config, params):
    return torch.optim.AdamW(params, lr=config["lr"], weight_decay=config["weight_decay"])


spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, metrics={"accuracy": accuracy}, batch_size=32)
# --8<-- [end:grid_spec]

# --8<-- [start:grid]
from cerebro_automl.adapters.search import grid_search

result = grid_search(spec, data, {"lr": [1e-3, 1e-2], "weight_decay": [1e-4, 1e-2]},
                     epochs=2, fuse=4, executor="local")        # fuse passes on to the Session
# --8<-- [end:grid]
assert len(result.history) == 8

# --8<-- [start:keys]
strict = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, batch_size=32,
                      fuse_keys=("lr", "weight_decay"))         # only these may differ in a group
# --8<-- [end:keys]
with Session(strict, data, fuse=4, executor="local") as s:
    s.add({"lr": 1e-3, "weight_decay": 0.0, "tag": "a"}, epochs=1)
    s.add({"lr": 1e-2, "weight_decay": 0.0, "tag": "b"}, epochs=1)  # another tag: another group
    s.run()
    assert not s._fusion.groups
