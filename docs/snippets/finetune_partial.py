import numpy as np
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session, TrainingSpec, accuracy

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 3, 16, 16)).astype("float32")
y = (X[:, 0].mean(axis=(1, 2)) > 0).astype("int64")
data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.25)


def block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


def pretrained_resnet():  # stands in for timm.create_model("resnet18", pretrained=True)
    torch.manual_seed(0)
    return nn.Sequential(block(3, 8), block(8, 8), block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))


# --8<-- [start:partial]
def model_fn(config):
    model = pretrained_resnet()
    model[-1] = nn.Linear(16, 2)                     # a new head for this task
    model.requires_grad_(False)                      # freeze everything...
    for layer in model[-config["train_last"]:]:      # ...but the last few layers
        layer.requires_grad_(True)
    return model


spec = TrainingSpec(model_fn=model_fn, metrics={"accuracy": accuracy}, batch_size=16,
                    optimizer_fn=lambda c, params: torch.optim.SGD(params, lr=c["lr"], momentum=0.9))

with Session(spec, data, executor="local") as s:
    for train_last in (1, 4):
        s.add({"train_last": train_last, "lr": 0.05}, epochs=2)
    s.run()
    state = s.model(0).state()       # what hopped: the head, and BatchNorm's statistics
    whole = s.model(0).build()       # the whole network, the frozen layers included
# --8<-- [end:partial]
frozen = {n for n, p in whole.named_parameters() if not p.requires_grad}
assert "base" in state and frozen and frozen.isdisjoint(state["model"])
assert set(state["model"]) >= {"5.weight", "5.bias", "0.1.running_mean"}
