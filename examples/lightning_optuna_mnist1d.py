"""A LightningModule, unmodified, tuned by Optuna on MOP (MNIST-1D).

    python examples/lightning_optuna_mnist1d.py [--trials 16] [--epochs 6]

`LitMNIST1D` is an ordinary LightningModule: it logs in training_step and
validation_step and returns an optimizer with a scheduler from
configure_optimizers. `LightningSpec` hands it to the Optuna adapter as is;
the logged `val_acc` (over the whole test set) is what the study maximizes.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections import Counter

import cloudpickle
import distributed  # noqa: F401  (imported first, so that the log levels below stick)
import lightning.pytorch as L
import optuna
import torch
from torch.nn import functional as F

from cerebro_automl import PartitionedDataset
from cerebro_automl.adapters.lightning import LightningSpec
from cerebro_automl.adapters.optuna import optimize

from mnist1d_models import ConvNet, load_mnist1d

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import this file


class LitMNIST1D(L.LightningModule):
    def __init__(self, width: int = 32, lr: float = 1e-3, weight_decay: float = 0.0):
        super().__init__()
        self.save_hyperparameters()
        self.net = ConvNet(width)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=-1) == y).float().mean())

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr,
                                      weight_decay=self.hparams.weight_decay)
        scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def space(trial: optuna.Trial) -> dict:
    return {"width": trial.suggest_categorical("width", [16, 32, 64]),
            "lr": trial.suggest_float("lr", 3e-4, 1e-2, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=None, help="default: one per core")
    parser.add_argument("--samples", type=int, default=10000)
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    X, y, X_test, y_test = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=4, valid=(X_test, y_test))
    spec = LightningSpec(lambda config: LitMNIST1D(**config), batch_size=64,
                         logged=["train_loss", "val_loss", "val_acc"])
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    started = time.perf_counter()
    optimize(study, spec, data, space, n_trials=args.trials, epochs=args.epochs, metric="val_acc",
             n_workers=args.workers)
    wall = time.perf_counter() - started

    states = Counter(t.state.name.lower() for t in study.trials)
    print(f"\n{len(study.trials)} trials of LitMNIST1D: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    best = study.best_trial
    history = best.user_attrs["cerebro_history"]
    print(f"best trial #{best.number}: val_acc {best.value:.3f} with {best.params}")
    print("its epochs (val_acc logged by validation_step over the whole test set):")
    for h in history:
        print(f"  epoch {h['epoch']}: train_loss {h['train_loss']:.3f}  val_loss {h['val_loss']:.3f}  "
              f"val_acc {h['val_acc']:.3f}")
    print(f"{wall:.0f} s on {args.workers or 'all'} workers, cluster start included")


if __name__ == "__main__":
    main()
