"""An Optuna search that runs as a SLURM job and trains on 2 more SLURM jobs.

Submit it with ``sbatch scripts/slurm/search.sbatch FOLDER``: the study (sqlite)
and the checkpoints go to FOLDER. Cancelled (``scancel``, or the wall-time limit:
SLURM sends SIGTERM), the session closes, writes the checkpoints it queued and
releases FOLDER's lock, and leaving the ``with`` block closes the SLURMCluster,
which cancels the worker jobs. Submitting the same job again resumes the study
from its storage and checkpoints; with ``reproducible=True`` it ends with the study
an uninterrupted run gives. ``make slurm-test`` checks that on a one-node SLURM
(tests/test_slurm.py). Run with no FOLDER (as the docs tests run every snippet),
it only says so: the search needs SLURM and dask-jobqueue.

The model is a small MLP made slow on purpose (CEREBRO_SLURM_SLOW seconds of sleep
per batch), so that the test can cancel the job mid-run.
"""

import os
import sys
import time
from pathlib import Path

import numpy as np
import optuna
import torch
from torch import nn

from cerebro_automl import PartitionedDataset, TrainingSpec

SLOW = float(os.environ.get("CEREBRO_SLURM_SLOW", "0.25"))  # seconds of sleep per batch
N_TRIALS, EPOCHS = 10, 4


class SlowLinear(nn.Linear):
    def forward(self, x):
        time.sleep(SLOW)
        return super().forward(x)


def model_fn(config):
    return nn.Sequential(SlowLinear(8, config["width"]), nn.ReLU(), nn.Linear(config["width"], 3))


def optimizer_fn(config, params):
    return torch.optim.Adam(params, lr=config["lr"])


spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn, loss_fn=nn.functional.cross_entropy,
                    batch_size=32)


def make_data(rows: int = 600, valid_rows: int = 200, seed: int = 0) -> PartitionedDataset:
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(8, 3))
    X = rng.normal(size=(rows, 8)).astype(np.float32)
    Xv = rng.normal(size=(valid_rows, 8)).astype(np.float32)
    y, yv = (X @ w).argmax(1).astype(np.int64), (Xv @ w).argmax(1).astype(np.int64)
    return PartitionedDataset.from_arrays(X, y, num_partitions=2, valid=(Xv, yv))


def space(trial):
    return {"lr": trial.suggest_float("lr", 1e-3, 3e-1, log=True), "width": trial.suggest_int("width", 4, 24)}


def told(study, trial):  # each tell, in the job's output (the test watches it)
    print(f"trial {trial.number} {trial.state.name} value={trial.value} params={trial.params}", flush=True)


# --8<-- [start:search]
from cerebro_automl.adapters.optuna import optimize


def main(folder: Path) -> None:
    from dask_jobqueue import SLURMCluster
    from distributed import Client

    study = optuna.create_study(study_name="search", storage=f"sqlite:///{folder}/study.db",
                                direction="minimize", load_if_exists=True,   # a resubmitted job: the same study
                                sampler=optuna.samplers.TPESampler(n_startup_trials=4),
                                pruner=optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2))
    # The scheduler runs here, in the driver's job; each worker is a job of its own (1 core, 2 GB).
    with SLURMCluster(cores=1, processes=1, memory="2GB", walltime="00:30:00",
                      worker_extra_args=["--nthreads", "1"], log_directory=str(folder / "workers")) as cluster:
        cluster.scale(2)
        with Client(cluster) as client:
            result = optimize(study, spec, make_data(), space, n_trials=N_TRIALS, epochs=EPOCHS,
                              metric="val_loss", checkpoint_dir=str(folder / "checkpoints"),
                              reproducible=True, seed=0, client=client, min_workers=2, callbacks=[told])
    print(f"best: trial {result.study.best_trial.number} value={result.study.best_value}", flush=True)
# --8<-- [end:search]


if __name__ == "__main__" and len(sys.argv) < 2:
    print("the search runs on SLURM: sbatch scripts/slurm/search.sbatch FOLDER (make slurm-test)")
    sys.exit(0)

# --8<-- [start:main]
if __name__ == "__main__":
    folder = Path(sys.argv[1]).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        main(folder)
    except KeyboardInterrupt:  # SIGTERM (scancel, the wall-time limit) or Ctrl-C: the session has closed
        print("interrupted: submit the same job again to resume", flush=True)
        sys.exit(143)
# --8<-- [end:main]
