"""Hyperband on MOP against full training and Optuna's HyperbandPruner, on MNIST-1D.

    python examples/hyperband_mnist1d.py [--max-epochs 9] [--eta 3]

All three train the same configurations (drawn once from one space):
1. hyperband: Li et al.'s brackets, all at once in one MOP session; a model
   promoted to the next rung resumes from its paused state.
2. full training: every configuration to max_epochs on MOP (grid search).
3. Optuna: a study whose trials are those configurations (enqueue_trial), with
   HyperbandPruner(min_resource=1, max_resource=max_epochs), through the Optuna adapter.
Printed: the best validation accuracy, the epochs trained and the wall time of each.
"""

from __future__ import annotations

import argparse
import logging
import time

import distributed  # noqa: F401  (imported first, so that the log levels below stick)
import numpy as np
import optuna
import torch
from distributed import Client

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.hyperband import hyperband, hyperband_plan
from cerebro_automl.adapters.optuna import optimize
from cerebro_automl.adapters.search import run_configs
from cerebro_automl.executors.dask import start_local_cluster

from mnist1d_models import load_mnist1d, model_fn, optimizer_fn, sample_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=9)
    parser.add_argument("--eta", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("distributed").setLevel(logging.WARNING)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    X, y, X_val, y_val = load_mnist1d(args.samples)  # the held-out rows: the search selects on them
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2 * args.workers, valid=(X_val, y_val))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                        loss_fn=torch.nn.functional.cross_entropy,
                        metrics={"accuracy": accuracy}, batch_size="batch_size")
    # hyperband draws its brackets' configurations from the sampler in this order
    rng = np.random.default_rng(args.seed)
    plan = hyperband_plan(args.max_epochs, args.eta)
    configs = [sample_config(rng) for bracket in plan for _ in range(bracket[0].n)]
    rows = []
    with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
        started = time.perf_counter()
        hb = hyperband(spec, data, sample_config, max_epochs=args.max_epochs, eta=args.eta,
                       metric="val_accuracy", mode="max", seed=args.seed, client=client)
        rows.append(("hyperband (MOP)", hb.best_value, hb.epochs_trained, time.perf_counter() - started))
        drawn = hb.history.sort_values("model_id", kind="stable").drop_duplicates("model_id").config
        assert list(drawn) == configs, "hyperband drew other configurations than planned"

        started = time.perf_counter()
        full = run_configs(spec, data, configs, epochs=args.max_epochs, metric="val_accuracy",
                           mode="max", seed=args.seed, client=client)
        rows.append(("full training (MOP)", full.best_value, len(full.history),
                     time.perf_counter() - started))

        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=args.seed),
                                    pruner=optuna.pruners.HyperbandPruner(
                                        min_resource=1, max_resource=args.max_epochs,
                                        reduction_factor=args.eta))
        for config in configs:
            study.enqueue_trial({k: v for k, v in config.items() if k != "batch_size"})
        started = time.perf_counter()
        optimize(study, spec, data, optuna_space, n_trials=len(configs), epochs=args.max_epochs,
                 metric="val_accuracy", seed=args.seed, client=client)
        rows.append(("Optuna HyperbandPruner (MOP)", study.best_value,
                     sum(len(t.intermediate_values) for t in study.trials), time.perf_counter() - started))

    print(f"\n{len(configs)} configurations, max_epochs={args.max_epochs}, eta={args.eta}, "
          f"{args.workers} workers, MNIST-1D {len(X)} train / {len(X_val)} validation rows\n")
    print("| tuner | best validation accuracy | epochs trained | wall (s) |")
    print("|---|---|---|---|")
    for name, best, epochs, wall in rows:
        print(f"| {name} | {best:.3f} | {epochs} | {wall:.1f} |")
    print("\nhyperband's rungs (bracket, rung, epochs: promoted / entered):")
    for d in hb.decisions:
        print(f"  {d.bracket}, {d.rung}, {d.epochs:>2}: {len(d.promoted)} / {len(d.values)}")


def optuna_space(trial: optuna.Trial) -> dict:
    """The same space as sample_config; enqueued trials get the drawn values."""
    arch = trial.suggest_categorical("arch", ["mlp", "cnn"])
    return {"arch": arch,
            "width": trial.suggest_categorical("width", [16, 32, 64, 128]),
            "lr": trial.suggest_float("lr", 3e-4, 1e-2, log=True),
            "weight_decay": trial.suggest_float("weight_decay", 1e-6, 1e-2, log=True),
            "batch_size": 64}


if __name__ == "__main__":
    main()
