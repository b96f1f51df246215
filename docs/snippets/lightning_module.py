import optuna
import torch
from torch.nn import functional as F

from tiny import data

# --8<-- [start:module]
import lightning.pytorch as L

class LitMLP(L.LightningModule):                    # an ordinary LightningModule, unmodified
    def __init__(self, width: int = 32, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(40, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=-1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
# --8<-- [end:module]

study = optuna.create_study(direction="maximize")
space = lambda t: {"width": 32, "lr": t.suggest_float("lr", 1e-3, 1e-2, log=True)}
# --8<-- [start:spec]
from cerebro_automl.adapters.lightning import LightningSpec
from cerebro_automl.adapters.optuna import optimize

spec = LightningSpec(lambda config: LitMLP(**config), batch_size=16,
                     logged=["val_loss", "val_acc"])    # optional: lets tuners check the metric up front
optimize(study, spec, data, space, n_trials=2, epochs=2, metric="val_acc", executor="local")   # any tuner
# --8<-- [end:spec]
assert len(study.trials) == 2
