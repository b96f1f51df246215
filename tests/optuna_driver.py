"""A driver process for the resume test: an Optuna search with a journal storage
and checkpoints, slow enough to be killed mid-run.  Run: python optuna_driver.py DIR"""

from __future__ import annotations

import sys
from pathlib import Path

import optuna

from cerebro_automl import PartitionedDataset
from cerebro_automl.adapters.optuna import optimize

from conftest import make_arrays
from models import make_spec, slow_model_fn

N_TRIALS, EPOCHS = 8, 4


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 1e-1, log=True),
            "width": trial.suggest_int("width", 4, 16)}


def open_study(folder: Path) -> optuna.Study:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(folder / "journal.log")))
    return optuna.create_study(study_name="resume", storage=storage, direction="minimize",
                               sampler=optuna.samplers.RandomSampler(seed=0), load_if_exists=True)


def data() -> PartitionedDataset:
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


def run(folder: Path) -> optuna.Study:
    study = open_study(folder)
    result = optimize(study, make_spec(model_fn=slow_model_fn), data(), space, n_trials=N_TRIALS,
                      epochs=EPOCHS, metric="val_loss", parallelism=3, executor="local",
                      n_workers=3, checkpoint_dir=str(folder / "checkpoints"))
    return result.study


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    run(Path(sys.argv[1]))
