# --8<-- [start:quickstart]
import numpy as np
import torch
from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy, EpochReport

X = np.random.default_rng(0).normal(size=(400, 40)).astype("float32")   # your rows ...
y = (X[:, 0] > 0).astype("int64") + (X[:, 1] > 0).astype("int64")       # ... and labels
spec = TrainingSpec(
    model_fn=lambda c: torch.nn.Sequential(torch.nn.Linear(40, c["width"]), torch.nn.ReLU(),
                                           torch.nn.Linear(c["width"], 10)),
    optimizer_fn=lambda c, params: torch.optim.Adam(params, lr=c["lr"]),
    loss_fn=torch.nn.functional.cross_entropy,
    metrics={"accuracy": accuracy},          # reported as val_accuracy
    batch_size=16,                           # or the name of a config key
)
data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.25)

with Session(spec, data, seed=0, executor="local") as s:   # leave out executor: a LocalCluster
    for lr in (1e-3, 3e-3):
        for width in (32, 64):
            s.add({"lr": lr, "width": width}, epochs=3)
    for r in s.reports():                    # EpochReport / ModelPaused / ModelFailed
        if isinstance(r, EpochReport) and r.epoch >= 2 and r.metrics["val_accuracy"] < 0.3:
            s.stop(r.model_id)               # prune; s.extend(id, epochs=...) resumes a paused one
    print(s.history)                         # one row per model-epoch (pandas): metrics,
                                             # config, seed, order, session_seconds, ...
    net = s.best("val_accuracy", mode="max").build()   # nn.Module with the trained weights
# --8<-- [end:quickstart]
assert isinstance(net, torch.nn.Module)
