"""Population-based training against random search and Hyperband on MNIST-1D.

    python examples/pbt_mnist1d.py [--epochs 9] [--population 8] [--out benchmarks/results]

All three tune the same space (a CNN's learning rate, weight decay and dropout)
on the same LocalCluster, with about the same number of epochs trained:
1. PBT: ``population`` members for ``epochs`` epochs; after every epoch the
   bottom quarter is replaced by forks of the top quarter with perturbed
   hyperparameters (x0.8 / x1.2, dropout to a neighbouring value, a quarter of
   values resampled).
2. random search: ``population`` configurations, each for ``epochs`` epochs.
3. Hyperband (max_epochs = ``epochs``, eta = 3): its brackets' own budget.
Writes the table (best test accuracy, epochs trained, wall time) to
``pbt.md`` and the PBT schedules to ``pbt_schedules.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import distributed  # noqa: F401  (imported before the log levels are set)
import numpy as np
import torch
from distributed import Client

from cerebro_automl import PartitionedDataset, TrainingSpec, accuracy
from cerebro_automl.adapters.hyperband import hyperband
from cerebro_automl.adapters.pbt import pbt, plot_pbt
from cerebro_automl.adapters.search import run_configs
from cerebro_automl.executors.dask import start_local_cluster

from mnist1d_models import load_mnist1d, model_fn, optimizer_fn

DROPOUTS = [0.0, 0.1, 0.2, 0.3]
MUTATIONS = {"lr": (1e-4, 3e-2), "weight_decay": (1e-7, 1e-1), "dropout": DROPOUTS}


def sample(rng: np.random.Generator) -> dict:
    """A fixed CNN; its optimizer and regularization hyperparameters vary."""
    return {"arch": "cnn", "width": 32, "batch_size": 64,
            "lr": float(10 ** rng.uniform(np.log10(3e-4), -2)),
            "weight_decay": float(10 ** rng.uniform(-6, -2)),
            "dropout": float(rng.choice(DROPOUTS))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=9)
    parser.add_argument("--population", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=10000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()

    X, y, X_test, y_test = load_mnist1d(args.samples)
    data = PartitionedDataset.from_arrays(X, y, num_partitions=2 * args.workers, valid=(X_test, y_test))
    spec = TrainingSpec(model_fn=model_fn, optimizer_fn=optimizer_fn,
                        loss_fn=torch.nn.functional.cross_entropy,
                        metrics={"accuracy": accuracy}, batch_size="batch_size")
    common = dict(metric="val_accuracy", mode="max", seed=args.seed)
    rows = []
    with start_local_cluster(args.workers) as cluster, Client(cluster) as client:
        # warm-up, untimed: the workers import torch and build a first model
        run_configs(spec, data, [sample(np.random.default_rng(99))], epochs=1, client=client, **common)
        started = time.perf_counter()
        result = pbt(spec, data, sample, population=args.population, epochs=args.epochs, interval=1,
                     mutations=MUTATIONS, client=client, **common)
        rows.append(("PBT", result.best_value, result.epochs_trained, time.perf_counter() - started))

        rng = np.random.default_rng(args.seed)
        started = time.perf_counter()
        random = run_configs(spec, data, [sample(rng) for _ in range(args.population)], epochs=args.epochs,
                             client=client, **common)
        rows.append(("random search", random.best_value, len(random.history), time.perf_counter() - started))

        started = time.perf_counter()
        hb = hyperband(spec, data, sample, max_epochs=args.epochs, eta=3, client=client, **common)
        rows.append(("Hyperband", hb.best_value, hb.epochs_trained, time.perf_counter() - started))

    table = "\n".join([
        f"PBT, random search and Hyperband on MNIST-1D ({len(X)} train / {len(X_test)} test rows), "
        f"{args.workers} workers, `python examples/pbt_mnist1d.py --epochs {args.epochs} "
        f"--population {args.population}`", "",
        "<!-- --8<-- [start:table] -->",
        "| tuner | best test accuracy | epochs trained | wall (s) |", "|---|---|---|---|",
        *(f"| {name} | {best:.3f} | {epochs} | {wall:.0f} |" for name, best, epochs, wall in rows),
        "<!-- --8<-- [end:table] -->", ""])
    best = result.schedules[result.best_model_id]
    schedule = "\n".join(f"  epochs {a}-{b}: lr {c['lr']:.2e}, weight_decay {c['weight_decay']:.1e}, "
                         f"dropout {c['dropout']}" for a, b, c in best)
    print("\n" + table)
    print(f"the best PBT member's schedule (model {result.best_model_id}):\n{schedule}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pbt.md").write_text(table + f"\nThe best PBT member's schedule (model {result.best_model_id}):\n\n"
                                f"```\n{schedule}\n```\n")
    (out / "pbt.json").write_text(json.dumps({"rows": rows, "best_schedule": best}, indent=2) + "\n")
    plot_pbt(result, ["lr", "weight_decay", "dropout"], path=out / "pbt_schedules.png")


if __name__ == "__main__":
    main()
