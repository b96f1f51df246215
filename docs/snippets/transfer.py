import numpy as np
import optuna
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, Session
from cerebro_automl.adapters.optuna import optimize

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 3, 16, 16)).astype("float32")
y = (X[:, 0].mean(axis=(1, 2)) > 0).astype("int64")
data = PartitionedDataset.from_arrays(X, y, num_partitions=2, valid_fraction=0.25)


def pretrained_cnn():
    torch.manual_seed(0)  # stands in for loading a checkpoint
    blocks = [nn.Sequential(nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
              for i in range(4)]
    return nn.Sequential(nn.Sequential(*blocks), nn.Flatten(), nn.Linear(8 * 16 * 16, 10))


# --8<-- [start:spec]
from cerebro_automl import FrozenFeatures, TrainingSpec, accuracy


def backbone_fn():
    net = pretrained_cnn()                      # e.g. torchvision.models.resnet50(weights=...)
    return net.requires_grad_(False)            # frozen: never trained, never hops


def head_fn(config):                            # only the part that trains
    return nn.Sequential(nn.Linear(8, config["width"]), nn.ReLU(), nn.Linear(config["width"], 2))


spec = TrainingSpec(
    model_fn=head_fn,
    optimizer_fn=lambda c, params: torch.optim.Adam(params, lr=c["lr"]),
    metrics={"accuracy": accuracy},
    batch_size=16,
    features=FrozenFeatures(
        backbone_fn,
        layers={"b2": "0.1", "b3": "0.2", "b4": "0.3"},  # name -> submodule path
        layer_key="layer",                               # config["layer"] picks one
        pool="avg",                                      # (rows, C, H, W) -> (rows, C)
    ),
)
# --8<-- [end:spec]

# --8<-- [start:session]
with Session(spec, data, executor="local") as s:
    for layer in ("b2", "b3", "b4"):
        s.add({"layer": layer, "width": 16, "lr": 1e-3}, epochs=2)
    history = s.run()
# --8<-- [end:session]
assert len(history) == 6 and history.val_loss.notna().all()


# --8<-- [start:optuna]
def space(trial):
    return {"layer": trial.suggest_categorical("layer", ["b2", "b3", "b4"]),
            "width": trial.suggest_categorical("width", [16, 64]),
            "lr": trial.suggest_float("lr", 1e-4, 1e-2, log=True)}


study = optuna.create_study(direction="maximize")
optimize(study, spec, data, space, n_trials=4, epochs=2, metric="val_accuracy", executor="local")
# --8<-- [end:optuna]
assert len(study.trials) == 4


# --8<-- [start:finetune]
def top_block_and_head(config):
    """Fine-tune the top block: cut below it, rebuild it from the pretrained weights."""
    top = pretrained_cnn()[0][3].requires_grad_(True)
    return nn.Sequential(top, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2))


finetune = TrainingSpec(
    model_fn=top_block_and_head,
    optimizer_fn=lambda c, params: torch.optim.SGD(params, lr=c["lr"], momentum=0.9),
    batch_size=16,
    features=FrozenFeatures(backbone_fn, layers={"b3": "0.2"}),  # no pooling: the block reads maps
)
# --8<-- [end:finetune]
with Session(finetune, data, executor="local") as s:
    s.add({"layer": "b3", "lr": 1e-2}, epochs=1)
    s.run()
    assert s.status(0) == "paused"
