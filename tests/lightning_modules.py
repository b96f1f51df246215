"""LightningModules written the way Lightning's documentation writes them; sent
to Dask workers by value (cloudpickle)."""

from __future__ import annotations

import sys

import cloudpickle
import lightning.pytorch as L
import pytorch_lightning as PL
import torch
from torch.nn import functional as F

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LitClassifier(L.LightningModule):
    """The docs' classifier: logs in both steps; configure_optimizers varies by ``form``."""

    def __init__(self, lr: float = 1e-2, width: int = 16, form: str = "optimizer"):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(width, 3))
        # buffers hop with the state_dict: they show what the hooks and counters saw
        self.register_buffer("epoch_starts", torch.zeros((), dtype=torch.long))
        self.register_buffer("epoch_ends", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen_epoch", torch.full((), -1, dtype=torch.long))
        self.register_buffer("seen_step", torch.full((), -1, dtype=torch.long))
        self.register_buffer("seen_batch_idx", torch.full((), -1, dtype=torch.long))

    def forward(self, x):
        return self.net(x)

    def on_train_epoch_start(self):
        self.epoch_starts += 1

    def on_train_epoch_end(self):
        self.epoch_ends += 1

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.seen_epoch.fill_(self.current_epoch)
        self.seen_step.fill_(self.global_step)
        self.seen_batch_idx.fill_(max(int(self.seen_batch_idx), batch_idx))
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log_dict({"val_loss": F.cross_entropy(logits, y),
                       "val_acc": (logits.argmax(-1) == y).float().mean()})

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        form = self.hparams.form
        if form == "optimizer":
            return opt
        if form == "list":
            return [opt]
        if form == "tuple":
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]
        if form == "dict_epoch":
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                "interval": "epoch", "frequency": 2}}
        if form == "dict_step":
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9),
                "interval": "step", "frequency": 3}}
        if form == "plateau":
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, threshold=10.0),
                "monitor": "train_loss"}}
        if form == "plateau_on_val":
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
                    "monitor": "val_loss"}
        if form == "two_optimizers":
            return [opt, torch.optim.Adam(self.parameters())]
        if form == "first_layer_only":  # the rest has requires_grad but is never stepped
            return torch.optim.SGD(self.net[0].parameters(), lr=self.hparams.lr)
        raise ValueError(form)


class PLClassifier(PL.LightningModule):
    """The same classifier written against the pytorch_lightning package."""

    def __init__(self, lr: float = 1e-2, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class LitTwin(L.LightningModule):
    """PLClassifier, line for line, against lightning.pytorch."""

    def __init__(self, lr: float = 1e-2, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(width, 3))

    forward = PLClassifier.forward
    training_step = PLClassifier.training_step
    validation_step = PLClassifier.validation_step
    configure_optimizers = PLClassifier.configure_optimizers


class MeanLogger(LitClassifier):
    def validation_step(self, batch, batch_idx):
        self.log("val_max", self(batch[0]).max(), reduce_fx="max")


def classifier(config):
    return LitClassifier(config["lr"], config.get("width", 16), config.get("form", "optimizer"))


class CountingValidation(L.LightningModule):
    """Counts its validation batches in a buffer, writing it in place."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 3)
        self.register_buffer("val_batches", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_batches += 1
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LitFineTune(L.LightningModule):
    """A frozen "pretrained" trunk (seeded) under a trainable head, as a fine-tuning
    LightningModule freezes it in ``__init__``."""

    def __init__(self, lr: float = 1e-2, width: int = 16):
        super().__init__()
        self.save_hyperparameters()
        g = torch.Generator().manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 128), torch.nn.ReLU())
        with torch.no_grad():
            for p in self.trunk.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.trunk.requires_grad_(False)
        self.head = torch.nn.Sequential(torch.nn.Linear(128, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))

    def forward(self, x):
        return self.head(self.trunk(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
