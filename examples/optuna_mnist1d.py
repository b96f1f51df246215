"""Optuna (TPE + HyperbandPruner) tunes an MLP/CNN space on MNIST-1D with MOP.

    python examples/optuna_mnist1d.py [--trials 24] [--epochs 9] [--storage sqlite:///mnist1d.db]
        [--tensorboard runs/mnist1d] [--mlflow sqlite:///mlflow.db]
        [--scheduler tcp://HOST:PORT | --scheduler-file PATH]

The study asks configurations; the MOP session trains them together on the
embedded Dask LocalCluster (one worker per core, each holding 1/p of the data),
or with --scheduler / --scheduler-file on a Dask cluster you already run (its
workers need torch and cerebro_automl; this script sends its model code);
after each epoch the trial reports its validation accuracy and Hyperband prunes.
The held-out rows are split in two: a validation set the search selects on, and
a test set it never sees, on which the best trial's model is scored at the end.
The search runs with reproducible=True: the same trials, values and best model
whatever the number of workers or their timing.
The library's log prints the Dask dashboard link and one line per trial; in a
terminal a progress bar counts units and running, paused and failed models.
With a storage, `optuna-dashboard <storage>` shows the study live; with
--tensorboard, `tensorboard --logdir <dir>`; with --mlflow, `mlflow ui
--backend-store-uri <uri>`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import optuna
import pandas as pd
import distributed  # noqa: F401  (imported first, so that the log levels below stick)
import torch

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.callbacks import MLflow, TensorBoard
from cerebro_automl.results import plot_learning_curves

from mnist1d_models import load_mnist1d, model_fn, optimizer_fn


def space(trial: optuna.Trial) -> dict:
    arch = trial.suggest_categorical("arch", ["mlp", "cnn"])
    return {
        "arch": arch,
        # conditional parameters get their own names (Optuna's categorical spaces are fixed)
        "width": (trial.suggest_categorical("mlp_width", [32, 64, 128]) if arch == "mlp"
                  else trial.suggest_categorical("cnn_width", [16, 32, 64])),
        "lr": trial.suggest_float("lr", 3e-4, 1e-2, log=True),
        "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
        "batch_size": trial.suggest_categorical("batch_size", [32, 64, 128]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--workers", type=int, default=None,
                        help="workers of the embedded LocalCluster (default: one per core); with "
                             "--scheduler or --scheduler-file, wait until this many have joined")
    parser.add_argument("--scheduler", default=None, metavar="tcp://HOST:PORT",
                        help="run on the Dask scheduler at this address (tcp:// or tls://) "
                             "instead of an embedded LocalCluster")
    parser.add_argument("--scheduler-file", default=None, metavar="PATH",
                        help="run on the Dask scheduler named in this file "
                             "(written by `dask scheduler --scheduler-file PATH`)")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--storage", default=None, help="e.g. sqlite:///mnist1d.db (default: in memory)")
    parser.add_argument("--checkpoint-dir", default=None, help="resume after a crash (with --storage)")
    parser.add_argument("--tensorboard", default=None, help="write TensorBoard runs to this folder")
    parser.add_argument("--mlflow", default=None, help="log to this MLflow tracking URI")
    parser.add_argument("--plot", default=None, help="save the best trials' learning curves there (PNG)")
    args = parser.parse_args()
    problem = cluster_problem(args.scheduler, args.scheduler_file)
    if problem:
        parser.error(problem)
    # cerebro_automl prints its own lines to stderr (session start with the dashboard
    # link, one line per trial, failures); Dask's and Optuna's only when they warn
    logging.getLogger("distributed").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    callbacks = ([TensorBoard(args.tensorboard)] if args.tensorboard else []) + \
        ([MLflow(args.mlflow, experiment="mnist1d")] if args.mlflow else [])

    X, y, X_held, y_held = load_mnist1d(args.samples)
    half = len(X_held) // 2  # validation (the search selects on it) and test (never seen)
    X_val, y_val, X_test, y_test = X_held[:half], y_held[:half], X_held[half:], y_held[half:]
    data = PartitionedDataset.from_arrays(X, y, num_partitions=args.partitions, valid=(X_val, y_val))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                        loss_fn=torch.nn.functional.cross_entropy,
                        metrics={"accuracy": accuracy}, batch_size="batch_size")
    study = optuna.create_study(
        study_name="mnist1d", storage=args.storage, load_if_exists=True, direction="maximize",
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=8),
        pruner=optuna.pruners.HyperbandPruner(min_resource=1, max_resource=args.epochs,
                                              reduction_factor=3))

    started = time.perf_counter()
    with cluster_client(args.scheduler, args.scheduler_file) as client:
        # An existing cluster's workers may still be joining: wait for --workers of them.
        workers = {"n_workers": args.workers} if client is None else {"min_workers": args.workers}
        # reproducible: the same trials, values and best model on any number of workers;
        # parallelism 4: TPE learns more from 4 trials at a time than from 8
        result = optimize(study, spec, data, space, n_trials=args.trials, epochs=args.epochs,
                          metric="val_accuracy", client=client, checkpoint_dir=args.checkpoint_dir,
                          session_callbacks=callbacks, reproducible=True, parallelism=4, **workers)
        workers_text = "1 worker" if args.workers == 1 else f"{args.workers or 'all'} workers"
        where = (f"{workers_text}, cluster start included" if client is None
                 else f"the Dask cluster at {client if isinstance(client, str) else client.scheduler.address}")
    wall = time.perf_counter() - started

    states = Counter(t.state.name for t in study.trials)
    epochs = sum(len(t.intermediate_values) for t in study.trials)
    print(f"\n{len(study.trials)} trials on MNIST-1D ({len(X)} train / {len(X_val)} validation / "
          f"{len(X_test)} test rows): "
          + ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())))
    print(f"epochs trained: {epochs} of {len(study.trials) * args.epochs} without pruning")
    top = sorted((t for t in study.trials if t.value is not None), key=lambda t: -t.value)[:5]
    print("\ntop trials (validation accuracy):")
    for t in top:
        print(f"  #{t.number:<3} {t.value:.3f}  {t.params}")
    if args.plot:
        plot_learning_curves(study_history(study), "val_accuracy", mode="max", top=6, path=args.plot,
                             label=lambda row: f"trial {row['model_id']}: " + ", ".join(
                                 f"{k}={v:.2g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in row["config"].items()),
                             title="MNIST-1D, Optuna + Hyperband on MOP: the 6 best trials")
    best = study.best_trial
    test_accuracy = score(result.best_model(), X_test, y_test)
    print(f"\nbest trial #{best.number}: validation accuracy {best.value:.3f}, test accuracy "
          f"{test_accuracy:.3f} (published CNN baseline ~0.94)")
    print(f"\n{wall:.0f} s on {where}")


def score(model: torch.nn.Module, X: Any, y: Any) -> float:
    """The accuracy of ``model`` on rows the search never saw."""
    model.eval()
    with torch.no_grad():
        return float((model(torch.as_tensor(X)).argmax(1) == torch.as_tensor(y)).float().mean())


def cluster_problem(scheduler: str | None, scheduler_file: str | None) -> str | None:
    """Why --scheduler and --scheduler-file cannot be used as given, or None."""
    if scheduler is not None and scheduler_file is not None:
        return (f"--scheduler {scheduler} and --scheduler-file {scheduler_file} both name a "
                "scheduler; give one of them")
    if scheduler is not None and not scheduler.startswith(("tcp://", "tls://")):
        return (f"--scheduler is {scheduler!r}, but must be a Dask scheduler address that starts "
                "with tcp:// or tls://, such as tcp://10.0.0.5:8786")
    return None


@contextlib.contextmanager
def cluster_client(scheduler: str | None, scheduler_file: str | None) -> Iterator[Any]:
    """What the session takes as ``client=``: the scheduler address as given, a
    ``distributed.Client`` of the scheduler in ``scheduler_file`` (closed at the end),
    or None (an embedded LocalCluster)."""
    if scheduler_file is None:
        yield scheduler
        return
    from distributed import Client

    with Client(scheduler_file=scheduler_file) as client:
        yield client


def study_history(study: optuna.Study) -> pd.DataFrame:
    """The study as a session history: one row per trial-epoch, from the per-epoch
    metrics each trial keeps in its user attrs."""
    return pd.DataFrame([{"model_id": t.number, **epoch, "config": t.params}
                         for t in study.trials for epoch in t.user_attrs.get("cerebro_history", [])])


if __name__ == "__main__":
    main()
