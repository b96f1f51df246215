"""A driver process for the reproducible resume tests: an Optuna search with
reproducible=True, a journal storage and checkpoints, that SIGKILLs itself at a
chosen point of its run.  Run: python optuna_resume_driver.py DIR [KILL [REPORT_EVERY]]

KILL (none: run to the end) is one of
  ``told:N``   right after the N-th tell (mid-time: its later tells are not made),
  ``pruner:N`` at the N-th call of the pruner (the time's earlier prunes are decided),
  ``asked:N``  in the space of trial N, after its ask (a RUNNING trial with no config).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import optuna

from cerebro_automl import PartitionedDataset
from cerebro_automl.adapters.optuna import optimize

from conftest import make_arrays
from models import make_spec

N_TRIALS, EPOCHS, PARALLELISM = 12, 4, 3


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillingPruner(optuna.pruners.BasePruner):
    """SuccessiveHalvingPruner, killing the process at its ``kill_at``-th call."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.inner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
        self.kill_at, self.calls = kill_at, 0

    def prune(self, study: optuna.Study, trial: Any) -> bool:
        self.calls += 1
        if self.calls == self.kill_at:
            die()
        return self.inner.prune(study, trial)


def open_study(folder: Path, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(folder / "journal.log")))
    # TPE after 4 trials: the asks depend on the study's history, so a resume must restore it exactly
    return optuna.create_study(study_name="resume", storage=storage, direction="minimize",
                               sampler=optuna.samplers.TPESampler(n_startup_trials=4),
                               pruner=pruner or KillingPruner(), load_if_exists=True)


def data() -> PartitionedDataset:
    X, y, Xv, yv = make_arrays()
    return PartitionedDataset.from_arrays(X, y, num_partitions=3, valid=(Xv, yv))


def run(folder: Path, kill: str | None = None, n_workers: int = 1, report_every: str = "epoch") -> optuna.Study:
    """The search, in ``folder``; ``kill`` as in the module docstring."""
    what, n = (kill.split(":")[0], int(kill.split(":")[1])) if kill else (None, -1)
    told: list[int] = []

    def after_tell(study: optuna.Study, trial: Any) -> None:
        told.append(trial.number)
        if what == "told" and len(told) == n:
            die()

    def space(trial: optuna.Trial) -> dict[str, Any]:
        if what == "asked" and trial.number == n:
            die()
        return {"lr": trial.suggest_float("lr", 1e-3, 3e-1, log=True),
                "width": trial.suggest_int("width", 4, 24)}

    study = open_study(folder, KillingPruner(n if what == "pruner" else None))
    result = optimize(study, make_spec(), data(), space, n_trials=N_TRIALS, epochs=EPOCHS, metric="val_loss",
                      parallelism=PARALLELISM, seed=3, reproducible=True, callbacks=[after_tell],
                      executor="local", n_workers=n_workers, checkpoint_dir=str(folder / "checkpoints"),
                      report_every=report_every)
    return result.study


if __name__ == "__main__":
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    run(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None,
        report_every=sys.argv[3] if len(sys.argv) > 3 else "epoch")
